# benches/gpu/alloc_bench.py (training and the Python alloc/free loop) through one of
# streamalloc's PyTorch doors, unchanged otherwise, so its figures compare with earlier runs.
#   python3 bench_wrap.py ALLOC WORK OUT.json
# ALLOC: native | sa_native | sa_pluggable | sa_expandable (the driver sets
# STREAMALLOC_CONF=expandable_segments:true). WORK: gpt2 | resnet | micro.
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GPU = os.path.dirname(HERE)
alloc, work, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, GPU)  # alloc_bench imports micro_loop from its own folder
if alloc != "native":
    import streamalloc.torch as st

    door = "pluggable" if alloc == "sa_pluggable" else "native"
    plain_install = st.install

    def install(*args, **kwargs):
        # alloc_bench calls install() with no arguments: give it the door asked for here
        kwargs.setdefault("door", door)
        plain_install(*args, **kwargs)
        if st.door() != door:
            raise RuntimeError(f"asked for door {door!r}, streamalloc.torch.door() says {st.door()!r}")
        print(f"bench_wrap: streamalloc door {st.door()}", flush=True)

    st.install = install
sys.argv = [os.path.join(GPU, "alloc_bench.py"), "native" if alloc == "native" else "streamalloc", work, out]
runpy.run_path(sys.argv[0], run_name="__main__")
