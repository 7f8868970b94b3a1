#!/bin/bash
# session 5, device call 4: the GPU suite and the write kernel's bytes with the new defaults
mkdir -p $OUT/r
timeout 110 python3 bench/ab_write.py --base bench/_ab_base_write.py --base-codecs bench/_ab_base_codecs.py --cases int4_kivi-k,int4_kivi-v,int2_kivi-k,int2_kivi-v,nvfp4,fp8_e4m3 --no-proofs --rounds 1 --out $OUT/r/ab_write_defaults.json > $OUT/r/ab_write_defaults.log 2>&1; echo "rc=$?" >> $OUT/r/ab_write_defaults.log
timeout 440 python3 -m pytest -q -m gpu -p no:cacheprovider > $OUT/r/gpu_suite.log 2>&1; echo "rc=$?" >> $OUT/r/gpu_suite.log
tar -C $OUT -czf $OUT/call4.tgz r && rm -rf $OUT/r
tar -xzOf $OUT/call4.tgz r/ab_write_defaults.log | grep -v '^{' | tail -n 14
tar -xzOf $OUT/call4.tgz r/gpu_suite.log | tail -n 25
