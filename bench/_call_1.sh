set -x
nvidia-smi --query-gpu=name --format=csv
python3 bench/loads_roofline.py --schemes bf16,fp8_e4m3,mxfp4,nvfp4 --pages 16,64 --layouts nhd,hnd --configs "64,2,2;128,4,2" --hf 0,1 --out $OUT/loads_hnd.json 2>&1 | tee $OUT/loads_hnd.log
python3 bench/loads_roofline.py --schemes fp8_e4m3,nvfp4 --pages 1 --layouts nhd --configs "64,2,2;128,4,2" --hf 0 --out $OUT/loads_p1.json 2>&1 | tee $OUT/loads_p1.log
python3 bench/ab_decode.py --schemes int4_kivi,int2_kivi --shape 1,32,8,128,131072 --variants "cur; cur sp=132; cur sp=64; cur sp=32; cur sp=16; cur sp=128 rl=0" --out $OUT/ab_b1.json 2>&1 | tee $OUT/ab_b1.log
