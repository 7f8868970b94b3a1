set -x
python3 -m pytest -q -p no:cacheprovider tests/test_triton_layout.py 2>&1 | tail -5 | tee $OUT/gpu_layout_tests.log
python3 bench/ab_decode.py --schemes mxfp4,nvfp4,fp4_e2m1,fp8_e4m3,bf16 --variants "cur; cur hnd=1; cur hnd=1 bn=128 w=4; cur hnd=1 hf=1" --out $OUT/ab_hnd_b32.json 2>&1 | tee $OUT/ab_hnd_b32.log | tail -25
python3 bench/ab_decode.py --schemes int4_kivi,int2_kivi --variants "cur; cur hnd=1; cur sp=1; cur sp=2; cur sp=4; cur hnd=1 sp=2" --out $OUT/ab_kivi_b32.json 2>&1 | tee $OUT/ab_kivi_b32.log | tail -16
python3 bench/ab_decode.py --schemes nvfp4,mxfp4,fp8_e4m3,int4_kivi --shape 1,32,8,128,131072 --variants "cur; cur hnd=1; cur sp=32; cur hnd=1 sp=32; cur hnd=1 sp=64" --out $OUT/ab_b1.json 2>&1 | tee $OUT/ab_b1.log | tail -24
