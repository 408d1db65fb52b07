import sys, collections
def load(path):
    rows=[]
    for line in open(path):
        line=line.rstrip()
        if not line: continue
        stack, cnt = line.rsplit(' ',1)
        rows.append((stack.split(';'), int(cnt)))
    return rows
rows=load(sys.argv[1])
want=sys.argv[2]  # thread name substring
sel=[(f,c) for f,c in rows if any(want in x for x in f[:3])]
n=sum(c for _,c in sel)
print("samples", n)
incl=collections.Counter(); leafc=collections.Counter()
for f,c in sel:
    for x in set(f): incl[x[:120]]+=c
    leafc[f[-1][:120]]+=c
for k,v in incl.most_common(int(sys.argv[3]) if len(sys.argv)>3 else 40): print(f"{v/n:6.1%} {k}")
print("--- leaves")
for k,v in leafc.most_common(15): print(f"{v/n:6.1%} {k}")
