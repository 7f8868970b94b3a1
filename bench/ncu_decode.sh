#!/bin/bash
# Nsight Compute profile of the decode kernel per scheme: bash bench/ncu_decode.sh OUTDIR SCHEME...
# Writes OUTDIR/SCHEME.txt (sections: speed of light, occupancy, warp states, scheduler, memory) and
# OUTDIR/SCHEME-sass.csv (per SASS instruction: executed instructions and stall samples by reason).
out=$1; shift
mkdir -p "$out"
for s in "$@"; do
  ncu --set full --import-source no -k regex:decode_split --launch-skip 1 --launch-count 1 \
      -f -o "/tmp/ncu-$s" python3 bench/ncu_decode.py --scheme "$s" > "$out/$s-run.log" 2>&1
  ncu -i "/tmp/ncu-$s.ncu-rep" --print-details all > "$out/$s.txt" 2>&1
  ncu -i "/tmp/ncu-$s.ncu-rep" --page source --csv --print-source sass > "$out/$s-sass.csv" 2>&1
done
