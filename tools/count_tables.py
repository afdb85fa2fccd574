"""Lists, dicts and sets held as attributes (self.x = ...) in shardopt, and those indexed by
parameter or bucket: ``python tools/count_tables.py [ROOT]``."""
import ast, os, re, sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The reduction, step and update paths: their folders, and (for a checkout from before the folders)
# the flat modules that now live in them, plus the flat buffers and the weight gathers they use.
PATHS = ("reduce/", "step/", "update/", "core/_flat", "comm/_gathers", "_reducer", "_grad_store", "_rounds",
         "_forward_order", "_held_bytes", "_sharded_buffer", "_binding", "_usage_checks", "_step_agreement", "_skips",
         "_gathers", "_flat", "_grad_placeholder", "_muon_packing", "_agreement", "_step_message")
PER = re.compile(r"params|buckets|bucket_|local_ranges|_placeholders|placeholder|\bn\b|len\(|layout\.|_where|accumulators|names")

INDEX = {"i", "index", "b", "bucket", "kb", "key", "idx"}
TABLE_CALLS = {"local_ranges", "bucket_local_ranges", "bucket_pieces", "bucket_shard_ranges"}

def indexed(cls, attr):
    """self.attr[i], self.attr.get(i), self.attr.add(i), i in self.attr ... with a parameter or bucket index."""
    for n in ast.walk(cls):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == attr:
            sl = n.slice
            if isinstance(sl, ast.Attribute) and sl.attr == "buffer":
                continue  # a flat buffer's index (reducers[b.buffer]), not a bucket's
            names = {x.id for x in ast.walk(sl) if isinstance(x, ast.Name)}
            if names & INDEX or (isinstance(sl, ast.Call) and getattr(sl.func, "id", "") == "id"):
                return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Attribute) \
                and n.func.value.attr == attr and n.func.attr in ("get", "add", "pop", "setdefault") and n.args:
            names = {x.id for x in ast.walk(n.args[0]) if isinstance(x, ast.Name)}
            if names & INDEX:
                return True
    return False

def table_value(v):
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in TABLE_CALLS:
        return True
    if isinstance(v, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(v, ast.BinOp) and isinstance(v.op, ast.Mult) and isinstance(v.left, ast.List):
        return True
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("list", "dict", "set"):
        return True
    return False

RECORDS = re.compile(r"^(list\(params\)|list\(buckets\)|list\(records\)|\[b for r in self.reducers for b in r.buckets\]|\[self.buckets\[i\] for i in .*|\[\])$")


def count(root: str) -> tuple[list[str], list[str], list[str]]:
    """(every list/dict/set attribute, those in the paths indexed by parameter or bucket, those of them
    that hold the records or parameters themselves) under ``root``/shardopt."""
    found, per = [], []
    for dirpath, _, files in os.walk(os.path.join(root, "shardopt")):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, os.path.join(root, "shardopt"))
            src = open(path).read()
            tree = ast.parse(src)
            for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
                seen = set()
                for node in ast.walk(cls):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) and node.value else []
                    for t in targets:
                        elts = t.elts if isinstance(t, ast.Tuple) else [t]
                        vals = node.value.elts if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) else [node.value]
                        for tt, v in zip(elts, vals):
                            if (isinstance(tt, ast.Attribute) and isinstance(tt.value, ast.Name) and tt.value.id == "self"
                                    and table_value(v) and tt.attr not in seen):
                                seen.add(tt.attr)
                                seg = ast.get_source_segment(src, v) or ""
                                name = f"{rel}:{cls.name}.{tt.attr}"
                                found.append(name)
                                in_paths = any(rel.startswith(p) or rel == p.lstrip("/") + ".py" or rel == p + ".py"
                                               for p in PATHS)
                                if in_paths and (PER.search(seg) or indexed(cls, tt.attr)):
                                    per.append(f"{name} = {seg[:70]}")
    holders = [p for p in per if RECORDS.match(p.split(" = ", 1)[1])]
    return found, per, holders


if __name__ == "__main__":
    found, per, holders = count(ROOT)
    print(f"list/dict/set attributes in shardopt/: {len(found)}")
    print(f"of them in the reduction, step and update paths and indexed by parameter or bucket: {len(per)}")
    print(f"  of which hold something else than the records or the parameters themselves: {len(per) - len(holders)}")
    for p in per:
        print(("  [records/params] " if p in holders else "  [table] ") + p)
