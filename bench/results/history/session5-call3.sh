#!/bin/bash
# session 5, device call 3 (copied to bench/results/history/session5-call3.sh)
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/r/gpu.txt
timeout 200 python3 bench/ab_write.py --base bench/_ab_base_write.py --base-codecs bench/_ab_base_codecs.py --cases nvfp4,int4_kivi-k,int4_kivi-v --sweep --no-proofs --out $OUT/r/ab_write5b.json > $OUT/r/ab_write5b.log 2>&1; echo "rc=$?" >> $OUT/r/ab_write5b.log
timeout 110 python3 bench/ab_decode.py --base bench/_ab_base_decode.py --schemes int4_kivi,int2_kivi --variants "base; cur; cur ktile=0; cur nreg=200; cur w=4" --out $OUT/r/ab_kivi.json > $OUT/r/ab_kivi.log 2>&1; echo "rc=$?" >> $OUT/r/ab_kivi.log
timeout 60 python3 - > $OUT/r/graph_smoke.log 2>&1 <<'P'
import sys, json; sys.path.insert(0, "bench")
import decode_bench as db
shape = (32, 32, 8, 128, 8192)
for row in (db.sdpa_case(shape), db.decode_case("fp8_e4m3", shape, 16), db.decode_case("fp8_e4m3", shape, 16, rotation=True),
            db.decode_case("nvfp4", shape, 16), db.decode_case("fp8_e4m3", (4, 32, 8, 128, 1024), 16, backend="torch"),
            db.write_case("fp8_e4m3"), db.write_case("int4_kivi"), db.write_case("fp8_e4m3", rotation=True)):
    print(json.dumps({k: row.get(k) for k in ("op", "backend", "scheme", "rotation", "timing", "time_us", "eager_time_us")}), flush=True)
P
echo "rc=$?" >> $OUT/r/graph_smoke.log
timeout 100 python3 bench/decode_bench.py --rotation-writes --rounds 3 --out $OUT/r/rotation_writes.json > $OUT/r/rotation_writes.log 2>&1; echo "rc=$?" >> $OUT/r/rotation_writes.log
tar -C $OUT -czf $OUT/call3.tgz r && rm -rf $OUT/r
tar -xzOf $OUT/call3.tgz r/graph_smoke.log r/ab_kivi.log | grep -v '^{' | tail -n 40
tar -xzOf $OUT/call3.tgz r/ab_write5b.log | grep -v '^{' | grep -v " sweep " | tail -n 20
tar -xzOf $OUT/call3.tgz r/rotation_writes.log | grep ratio | tail -n 8
