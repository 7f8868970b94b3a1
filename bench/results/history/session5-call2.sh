#!/bin/bash
# session 5, device call 2 (commands recorded in bench/results/history/session5-call2.sh)
set -x
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 170 python3 bench/ab_write.py --base bench/_ab_base_write.py --base-codecs bench/_ab_base_codecs.py --cases nvfp4,int4_kivi-k,int4_kivi-v,int2_kivi-k,int2_kivi-v --sweep --out $OUT/ab_write5.json > $OUT/ab_write5.log 2>&1; echo "rc=$?" >> $OUT/ab_write5.log
timeout 100 python3 bench/ab_decode.py --base bench/_ab_base_decode.py --schemes nvfp4,mxfp4,fp4_e2m1 --variants "base; cur; cur kt4=0; cur kt4=1" --out $OUT/ab_fp4.json > $OUT/ab_fp4.log 2>&1; echo "rc=$?" >> $OUT/ab_fp4.log
timeout 100 python3 bench/ab_rotation_decode.py --schemes fp8_e4m3,fp4_e2m1,nvfp4,int4_kivi --rounds 3 --out $OUT/ab_rot.json > $OUT/ab_rot.log 2>&1; echo "rc=$?" >> $OUT/ab_rot.log
timeout 70 python3 bench/decode_bench.py --rotation-writes --rounds 3 --out $OUT/rotation_writes.json > $OUT/rotation_writes.log 2>&1; echo "rc=$?" >> $OUT/rotation_writes.log
timeout 50 python3 bench/ab_decode.py --schemes fp8_e4m3 --shape 1,32,8,128,131072 --variants "cur; cur bn=64; cur sp=64; cur sp=128; cur s=2; cur w=4; cur bn=64 s=2" --out $OUT/ab_fp8_b1.json > $OUT/ab_fp8_b1.log 2>&1; echo "rc=$?" >> $OUT/ab_fp8_b1.log
timeout 50 python3 bench/ab_decode.py --schemes bf16,fp8_e4m3 --variants "cur; cur nreg=128; cur bn=64 s=3; cur w=4; cur bn=128" --out $OUT/ab_b32.json > $OUT/ab_b32.log 2>&1; echo "rc=$?" >> $OUT/ab_b32.log
timeout 55 python3 -m pytest -q -x tests/test_triton.py -k "fp4_keys_by_token or ptx_unpacking or (fp4 and decode)" > $OUT/fp4_tests.log 2>&1; echo "rc=$?" >> $OUT/fp4_tests.log
for f in $OUT/*.log; do echo "== $f"; grep -v '^{' $f | tail -n 25; done
