import csv, sys
fn = sys.argv[1]
rows = list(csv.reader(open(fn)))
hdr = rows[1]; data = rows[2:]
ia = hdr.index("Source"); isamp = hdr.index("Warp Stall Sampling (All Samples)"); iexe = hdr.index("Instructions Executed")
stall_cols = [i for i,h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
tot = sum(int(r[isamp]) for r in data if r[isamp].isdigit())
# totals per reason
from collections import Counter
c = Counter()
for r in data:
    for i in stall_cols:
        try: c[hdr[i]] += int(r[i])
        except: pass
print("total samples", tot, {k: round(v/tot,3) for k,v in c.most_common(8)})
# loop region: instructions executed most (top by executed count)
data2 = [(int(r[isamp]) if r[isamp].isdigit() else 0, r) for r in data]
data2.sort(key=lambda x: -x[0])
for s, r in data2[:int(sys.argv[2]) if len(sys.argv)>2 else 25]:
    reasons = sorted(((int(r[i]) if r[i].isdigit() else 0, hdr[i][6:]) for i in stall_cols), reverse=True)[:3]
    print(f"{s:6d} {r[iexe]:>8} {r[ia].strip()[:70]:70s} {reasons}")
