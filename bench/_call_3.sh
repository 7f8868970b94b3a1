set -x
python3 -m pytest -q -p no:cacheprovider tests/test_triton.py -k "split_counts or launch_defaults or kivi_key_rows" 2>&1 | tail -3 | tee $OUT/gpu_tests.log
python3 bench/ab_decode.py --schemes bf16 --variants "cur hnd=1; cur hnd=1 bn=64 w=4; cur hnd=1 bn=128 w=4; cur hnd=1 bn=64 w=2 s=3; cur hnd=1 bn=32 w=2 s=3; cur hnd=1 sp=16; cur hnd=1 sp=4" --out $OUT/ab_bf16.json 2>&1 | tee $OUT/ab_bf16.log | tail -9
python3 bench/ab_decode.py --schemes fp8_e4m3 --variants "cur hnd=1; cur hnd=1 bn=64 w=2 s=3; cur hnd=1 bn=64 w=4 s=3; cur hnd=1 bn=32 w=2 s=4; cur hnd=1 bn=32 w=1 s=3; cur hnd=1 sp=16; cur hnd=1 sp=4" --out $OUT/ab_fp8.json 2>&1 | tee $OUT/ab_fp8.log | tail -9
python3 bench/ab_decode.py --schemes mxfp4,nvfp4 --variants "cur hnd=1; cur hnd=1 sp=4; cur hnd=1 sp=16; cur hnd=1 s=3" --out $OUT/ab_fp4.json 2>&1 | tee $OUT/ab_fp4.log | tail -10
python3 bench/ab_decode.py --schemes int4_kivi,int2_kivi --shape 64,64,8,128,16384 --variants "cur; cur hnd=1; cur sp=1; cur sp=2; cur hnd=1 sp=1" --out $OUT/ab_kivi64.json 2>&1 | tee $OUT/ab_kivi64.log | tail -12
