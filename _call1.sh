#!/bin/bash
# session 7, call 1: A/B of branches nv7 and kvk7, their GPU tests, ncu of main's decode
set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
mkdir -p $OUT/logs
( cd _nv7 && timeout 200 python3 bench/ab_write.py --base bench/_ab_base_write.py --base-codecs bench/_ab_base_codecs.py --no-proofs --rounds 3 --cases nvfp4 --sweep --maxnreg 40,56 --out $OUT/logs/ab-nv7.json > $OUT/logs/ab-nv7.log 2>&1 ;
  timeout 90 python3 -m pytest -q -x tests/test_triton.py -k nvfp4 > $OUT/logs/test-nv7.log 2>&1 )
( cd _kvk7 && timeout 200 python3 bench/ab_write.py --base bench/_ab_base_write.py --base-codecs bench/_ab_base_codecs.py --no-proofs --rounds 3 --cases int4_kivi-k,int2_kivi-k --sweep --block-d 128,64,32 --out $OUT/logs/ab-kvk7.json > $OUT/logs/ab-kvk7.log 2>&1 ;
  timeout 90 python3 -m pytest -q -x tests/test_triton.py -k "kivi and write or block_d" > $OUT/logs/test-kvk7.log 2>&1 )
cd $OUT && tar czf logs.tgz logs && rm -rf logs
