#!/bin/bash
# Nsight Compute profile per scheme of the decode kernel, or with --write of the quantize-on-write kernel:
#   bash bench/ncu_decode.sh OUTDIR SCHEME...            decode_split_kernel (bench/ncu_decode.py)
#   bash bench/ncu_decode.sh OUTDIR --write SCHEME...    quantize_write_kernel (bench/ncu_write.py)
# A SCHEME of the form NAME:ARGS passes ARGS, commas for spaces (e.g. int4_kivi:--side=v to the write script,
# int4_kivi:--layout=HND,--plan=kivi_value_subnormal_codes=0 to the decode script).
# Writes OUTDIR/SCHEME.txt (sections: speed of light, occupancy, warp states, scheduler, memory) and
# OUTDIR/SCHEME-sass.csv (per SASS instruction: executed instructions and stall samples by reason).
# NCU_ARGS: more ncu options for the profiling run, e.g. NCU_ARGS="--clock-control none" (the GPU's own clocks; ncu
# otherwise locks them to base, which makes a memory-bound launch look compute-bound: ANALYSIS.md 189).
out=$1; shift
kernel=decode_split; script=bench/ncu_decode.py
if [ "$1" = "--write" ]; then kernel=quantize_write; script=bench/ncu_write.py; shift; fi
mkdir -p "$out"
for spec in "$@"; do
  s=${spec%%:*}; extra=""; [ "$spec" != "$s" ] && extra=${spec#*:}
  tag=$(echo "$spec" | tr -c 'A-Za-z0-9_\n' '_')
  # the first launch of the call between cudaProfilerStart/Stop (the script's second call; a KIVI decode's first
  # split launch is the paged splits', the residual window's second)
  ncu --set full $NCU_ARGS --import-source no -k regex:$kernel --profile-from-start off --launch-count 1 \
      -f -o "/tmp/ncu-$tag" python3 $script --scheme "$s" ${extra//,/ } > "$out/$tag-run.log" 2>&1
  ncu -i "/tmp/ncu-$tag.ncu-rep" --print-details all > "$out/$tag.txt" 2>&1
  ncu -i "/tmp/ncu-$tag.ncu-rep" --page source --csv --print-source sass > "$out/$tag-sass.csv" 2>&1
done
