#!/usr/bin/env python3
"""ddp_core against PyTorch itself, element for element.

  * bucket assignment: torch.distributed._compute_bucket_assignment_by_size on
    random tensors (dtypes, devices cpu/meta, sizes around the limits, sparse
    flags, explicit indices) vs `ddpdiag buckets --assign-case -`;
  * DDP buckets of the presets vs torch's assignment the way DDP rebuilds
    them (reversed parameters, explicit indices, [1 MiB, cap]);
  * `ddpdiag buckets` vs the buckets a real DistributedDataParallel (Gloo,
    one rank) reduces from its second iteration on, recorded by a comm hook:
    mixed dtypes, default and explicit caps, caps of 0, frozen parameters;
  * the presets' names and shapes vs torch.nn re-creations of the models;
  * DistributedSampler(range(N)) and torch.randperm vs `ddpdiag sampler --json`;
  * broadcast-test's chunks vs the broadcasts torch's _broadcast_coalesced
    (DDP's initial parameter sync) makes, traced through a process group;
  * `ddpdiag memory`'s parameters, buckets and gradients vs what a real DDP
    allocates (bucket buffers seen by a comm hook, gradients that alias
    them or not): mixed dtypes, frozen and sparse parameters, both
    gradient_as_bucket_view settings, default and explicit caps.

Run with the interpreter whose torch is the oracle (Debian's /usr/bin/python3
has 1.13; a 2.x venv for the other run). DDPDIAG_BIN names the binary.
Exit 77 (skip) when torch or the binary is missing. DDPDIAG_COMPAT_CASES scales
the number of random cases (default 1).

torch 2.x's randperm for n >= 214,748,364 (its other algorithm) runs only with
DDPDIAG_COMPAT_LARGE=1: torch needs 1.7 GB and ~35 s per case there.
"""
import contextlib
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import unittest

try:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.utils.data.distributed import DistributedSampler
except ImportError as e:  # pragma: no cover
    print(f"skip: this interpreter has no torch ({e})")
    sys.exit(77)

BIN = os.environ.get("DDPDIAG_BIN", "")
if not BIN or not os.access(BIN, os.X_OK):
    print(f"skip: DDPDIAG_BIN ('{BIN}') is not an executable ddpdiag binary")
    sys.exit(77)

TORCH_MAJOR = int(torch.__version__.split(".")[0])
TORCH_VERSION_FLAG = "2.x" if TORCH_MAJOR >= 2 else "1.13"
SCALE = int(os.environ.get("DDPDIAG_COMPAT_CASES", "1"))
# torch 2.11's DDP(bucket_cap_mb_list=[...]); older releases have no such argument.
HAS_CAP_LIST = "bucket_cap_mb_list" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
# and its skip_all_reduce_unused_params.
HAS_SKIP_UNUSED = "skip_all_reduce_unused_params" in inspect.signature(nn.parallel.DistributedDataParallel).parameters

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
DEVICES = ["cpu", "meta"]
MIB = 1024 * 1024

# Counters reported at the end (how many cases were compared).
STATS = {}


def bump(key, n=1):
    STATS[key] = STATS.get(key, 0) + n


def run_bin(args, stdin=None, env=None):
    p = subprocess.run([BIN] + args, input=stdin, capture_output=True, text=True, timeout=600, env=env)
    return p


def fake_tensor(numel, dtype, device):
    """A tensor with numel elements that costs one element of memory."""
    return torch.empty(1, dtype=dtype, device=device).expand(numel)


# ---------------------------------------------------------------- buckets


def random_bucket_case(rng):
    n = rng.choice([1, 2, 3, 5, 10, 30, 80])
    ndt = rng.choice([1, 1, 2, 3, 8])
    dtypes = rng.sample(list(DTYPES), ndt)
    devices = ["cpu"] if rng.random() < 0.6 else DEVICES
    nlimits = rng.choice([1, 2, 2, 3, 4])
    base = rng.choice([16, 100, 1000, 4096, MIB])
    limits = [rng.randint(1, 4 * base) for _ in range(nlimits)]
    if rng.random() < 0.2:  # exact hits of the >= boundary
        limits = [base] * nlimits
    tensors = []
    for _ in range(n):
        dt = rng.choice(dtypes)
        esize = torch.empty(0, dtype=DTYPES[dt]).element_size()
        if rng.random() < 0.2:
            numel = base // esize  # lands on the limit exactly when base is a limit
        else:
            numel = rng.choice([0, 1, rng.randint(1, 64), rng.randint(1, max(1, 2 * base // esize))])
        tensors.append(
            {"numel": numel, "dtype": dt, "device": rng.choice(devices), "sparse": rng.random() < 0.1}
        )
    indices = None
    if rng.random() < 0.5:
        indices = list(range(n))
        rng.shuffle(indices)
    return tensors, limits, indices


def torch_assignment(tensors, limits, indices):
    ts = [fake_tensor(t["numel"], DTYPES[t["dtype"]], t["device"]) for t in tensors]
    # torch indexes expect_sparse_gradient by tensor index (the parameter),
    # not by position.
    expect_sparse = [False] * len(tensors)
    for pos, t in enumerate(tensors):
        expect_sparse[indices[pos] if indices is not None else pos] = t["sparse"]
    result = dist._compute_bucket_assignment_by_size(ts, limits, expect_sparse, indices or [])
    if isinstance(result, tuple):
        buckets, sizes = result
    else:  # builds that return only the buckets
        buckets, sizes = result, None
    return [list(b) for b in buckets], (list(sizes) if sizes is not None else None)


def our_cases(cases):
    payload = []
    for tensors, limits, indices in cases:
        c = {
            "tensors": [
                {
                    "bytes": t["numel"] * torch.empty(0, dtype=DTYPES[t["dtype"]]).element_size(),
                    "dtype": t["dtype"],
                    "device": t["device"],
                    "sparse": t["sparse"],
                }
                for t in tensors
            ],
            "limits": limits,
        }
        if indices is not None:
            c["tensor_indices"] = indices
        payload.append(c)
    p = run_bin(["buckets", "--assign-case", "-"], stdin=json.dumps(payload))
    if p.returncode != 0:
        raise AssertionError(f"ddpdiag buckets --assign-case failed: {p.stderr}")
    return json.loads(p.stdout)


class BucketAssignmentTest(unittest.TestCase):
    def test_random_cases(self):
        rng = random.Random(20261129)
        cases = [random_bucket_case(rng) for _ in range(600 * SCALE)]
        ours = our_cases(cases)
        self.assertEqual(len(ours), len(cases))
        for k, ((tensors, limits, indices), mine) in enumerate(zip(cases, ours)):
            tb, tl = torch_assignment(tensors, limits, indices)
            pairs_t = list(zip(map(tuple, tb), tl if tl is not None else [None] * len(tb)))
            pairs_o = list(zip(map(tuple, mine["buckets"]), mine["size_limits"] if tl is not None else [None] * len(tb)))
            groups = {(t["dtype"], t["device"]) for t in tensors if not t["sparse"]}
            with self.subTest(case=k):
                self.assertEqual(pairs_o, pairs_t, f"case {k}: {tensors} {limits} {indices}")
            if indices is not None and len(groups) > 1:
                # Leftovers of several groups come last, in the iteration
                # order of torch's hash map.
                bump("bucket cases with leftovers of several groups (exact)")
            else:
                bump("bucket cases (exact)")

    def test_presets_as_ddp_rebuilds_them(self):
        for model in ["resnet50", "bert-large", "gpt2", "mlp"]:
            for cap_mb, first_mb in [(25, 1), (1, 1), (5, 0.5), (100, 1), (0.25, 0.25)]:
                with tempfile.TemporaryDirectory() as d:
                    out = os.path.join(d, "b.json")
                    p = run_bin(["buckets", "--model", model, "--bucket-cap-mb", str(cap_mb),
                                 "--first-bucket-mb", str(first_mb), "--json", out])
                    self.assertEqual(p.returncode, 0, p.stderr)
                    with open(out) as f:
                        report = json.load(f)
                self.assertEqual(report["schema"], "ddpdiag.report/1")
                layout = dump_layout(model)
                # torch's assignment over the preset's recorded ready order
                # (how backward of the real module makes gradients ready).
                order = dump_layout_doc(model)["ready_order"]
                self.assertEqual(sorted(order), list(range(len(layout))))
                tb, tl = torch_assignment(
                    [{"numel": numel_of(layout[i]["shape"]), "dtype": "float32", "device": "cpu", "sparse": False}
                     for i in order],
                    [int(first_mb * MIB), int(cap_mb * MIB)], order)
                ours = report["results"]["buckets"]
                self.assertEqual([b["param_indices"] for b in ours], tb, f"{model} cap {cap_mb}")
                if tl is not None:
                    self.assertEqual([b["size_limit_bytes"] for b in ours], tl)
                bump("preset bucket layouts")


# ---------------------------------------------------------------- presets


def numel_of(shape):
    n = 1
    for d in shape:
        n *= d
    return n


_LAYOUTS = {}


def dump_layout_doc(model):
    if model not in _LAYOUTS:
        p = run_bin(["buckets", "--model", model, "--dump-layout"])
        assert p.returncode == 0, p.stderr
        _LAYOUTS[model] = json.loads(p.stdout)
    return _LAYOUTS[model]


def dump_layout(model):
    return dump_layout_doc(model)["tensors"]


META = "meta"


class Bottleneck(nn.Module):
    def __init__(self, inplanes, planes, downsample):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False, device=META)
        self.bn1 = nn.BatchNorm2d(planes, device=META)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False, device=META)
        self.bn2 = nn.BatchNorm2d(planes, device=META)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False, device=META)
        self.bn3 = nn.BatchNorm2d(planes * 4, device=META)
        self.relu = nn.ReLU()
        self.downsample = downsample


def resnet50_module():
    m = nn.Module()
    m.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False, device=META)
    m.bn1 = nn.BatchNorm2d(64, device=META)
    inplanes = 64
    for stage, blocks in enumerate([3, 4, 6, 3]):
        planes = 64 << stage
        layer = []
        for b in range(blocks):
            ds = None
            if b == 0:
                ds = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, bias=False, device=META),
                                   nn.BatchNorm2d(planes * 4, device=META))
            layer.append(Bottleneck(inplanes, planes, ds))
            inplanes = planes * 4
        setattr(m, f"layer{stage + 1}", nn.Sequential(*layer))
    m.fc = nn.Linear(2048, 1000, device=META)
    return m


def bert_large_module():
    H, I = 1024, 4096

    def lin(i, o):
        return nn.Linear(i, o, device=META)

    m = nn.Module()
    m.embeddings = nn.Module()
    m.embeddings.word_embeddings = nn.Embedding(30522, H, device=META)
    m.embeddings.position_embeddings = nn.Embedding(512, H, device=META)
    m.embeddings.token_type_embeddings = nn.Embedding(2, H, device=META)
    m.embeddings.LayerNorm = nn.LayerNorm(H, device=META)
    m.encoder = nn.Module()
    layers = []
    for _ in range(24):
        l = nn.Module()
        l.attention = nn.Module()
        l.attention.self = nn.Module()
        l.attention.self.query, l.attention.self.key, l.attention.self.value = lin(H, H), lin(H, H), lin(H, H)
        l.attention.output = nn.Module()
        l.attention.output.dense = lin(H, H)
        l.attention.output.LayerNorm = nn.LayerNorm(H, device=META)
        l.intermediate = nn.Module()
        l.intermediate.dense = lin(H, I)
        l.output = nn.Module()
        l.output.dense = lin(I, H)
        l.output.LayerNorm = nn.LayerNorm(H, device=META)
        layers.append(l)
    m.encoder.layer = nn.ModuleList(layers)
    m.pooler = nn.Module()
    m.pooler.dense = lin(H, H)
    return m


class Conv1D(nn.Module):
    """transformers' Conv1D: weight [nx, nf]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf, device=META))
        self.bias = nn.Parameter(torch.empty(nf, device=META))


def gpt2_module():
    H = 768
    m = nn.Module()
    m.wte = nn.Embedding(50257, H, device=META)
    m.wpe = nn.Embedding(1024, H, device=META)
    blocks = []
    for _ in range(12):
        b = nn.Module()
        b.ln_1 = nn.LayerNorm(H, device=META)
        b.attn = nn.Module()
        b.attn.c_attn = Conv1D(3 * H, H)
        b.attn.c_proj = Conv1D(H, H)
        b.ln_2 = nn.LayerNorm(H, device=META)
        b.mlp = nn.Module()
        b.mlp.c_fc = Conv1D(4 * H, H)
        b.mlp.c_proj = Conv1D(H, 4 * H)
        blocks.append(b)
    m.h = nn.ModuleList(blocks)
    m.ln_f = nn.LayerNorm(H, device=META)
    return m


def mlp_module():
    return nn.Sequential(nn.Linear(784, 1024, device=META), nn.ReLU(), nn.Linear(1024, 1024, device=META),
                         nn.ReLU(), nn.Linear(1024, 10, device=META))


class PresetTest(unittest.TestCase):
    EXPECTED = {
        "resnet50": (resnet50_module, 161, 25_557_032),
        "bert-large": (bert_large_module, 391, 335_141_888),
        "gpt2": (gpt2_module, 148, 124_439_808),
        "mlp": (mlp_module, 6, 1_863_690),
    }

    def test_presets_match_torch_modules(self):
        for name, (build, ntensors, nparams) in self.EXPECTED.items():
            module = build()
            theirs = [(n, list(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
            ours = [(t["name"], t["shape"], t["dtype"]) for t in dump_layout(name)]
            self.assertEqual(ours, theirs, name)
            self.assertEqual(len(theirs), ntensors, name)
            self.assertEqual(sum(p.numel() for p in module.parameters()), nparams, name)
            bump("presets matched")

    def test_exported_file_loads(self):
        # The three lines of Python the README gives, on a small model.
        model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 4).to(torch.float16), nn.Linear(4, 2).double())
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "m.json")
            with open(path, "w") as f:
                json.dump([(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()], f)
            p = run_bin(["buckets", "--model", path, "--dump-layout"])
            self.assertEqual(p.returncode, 0, p.stderr)
            ours = [(t["name"], t["shape"], t["dtype"]) for t in json.loads(p.stdout)["tensors"]]
            theirs = [(n, list(q.shape), str(q.dtype)) for n, q in model.named_parameters()]
            self.assertEqual(ours, theirs)
            with open(path, "w") as f:
                f.write('[["a", [1, 2], "torch.float32"],\n ["b", [3] "torch.float32"]]')
            p = run_bin(["buckets", "--model", path])
            self.assertEqual(p.returncode, 2)
            self.assertIn(path, p.stderr)
            self.assertIn("line 2", p.stderr)


# ------------------------------------------------- DDP as it really runs


def ensure_world_of_one():
    """The default process group: Gloo, one rank (all DDP needs to build and
    rebuild its buckets)."""
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="ddpdiag-compat-pg-")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)


class LayoutModule(nn.Module):
    """A module whose parameters are a layout's tensors, in order. forward
    adds each trainable one (as float32) to a running sum, so backward makes
    their gradients ready in exactly the reverse order, as ddpdiag assumes."""

    def __init__(self, layout, forward_order=None):
        super().__init__()
        params = []
        for i, t in enumerate(layout):
            p = nn.Parameter(torch.zeros(t["shape"], dtype=DTYPES[t["dtype"].replace("torch.", "")]),
                             requires_grad=t.get("requires_grad", True))
            self.register_parameter(f"p{i}", p)  # layout names may hold dots
            params.append(p)
        # forward_order: the layout indices in the order forward uses them
        # (backward makes their gradients ready in the reverse order).
        self.ordered = [params[i] for i in (forward_order or range(len(params)))]

    def forward(self, x):
        for p in self.ordered:
            if p.requires_grad:
                x = x + p.float().sum()
        return x


def ddp_buckets_as_run(layout, bucket_cap_mb=None, first_bucket_bytes=None, find_unused=False,
                       forward_order=None, static_graph=False, cap_list=None, iterations=None, skip_unused=False):
    """The buckets real DDP reduces from its second iteration on (after it
    rebuilt them from the order gradients arrived in), recorded by a comm
    hook: layout indices per bucket, in bucket order. bucket_cap_mb None
    leaves DDP's default; first_bucket_bytes sets
    dist._DEFAULT_FIRST_BUCKET_BYTES, the knob DDP reads for the first
    bucket; find_unused sets find_unused_parameters; forward_order is
    LayoutModule's (a trainable parameter it leaves out is unused);
    static_graph sets static_graph; cap_list torch 2.x's bucket_cap_mb_list;
    iterations, a list, receives the buckets of each of the four iterations
    run; skip_unused sets torch 2.x's skip_all_reduce_unused_params (the
    buckets DDP skips never reach the hook)."""
    return ddp_buckets_of(LayoutModule(layout, forward_order), lambda m: m(torch.zeros(1)),
                          bucket_cap_mb, first_bucket_bytes, find_unused, static_graph, cap_list, iterations,
                          skip_unused)


def ddp_buckets_of(module, step, bucket_cap_mb=None, first_bucket_bytes=None, find_unused=False,
                   static_graph=False, cap_list=None, iterations=None, skip_unused=False):
    """ddp_buckets_as_run for any module: step(ddp_module) runs a forward and
    returns a tensor whose sum is the loss. Indices are positions in
    module.named_parameters(). With static_graph the buckets are those of the
    third iteration on (DDP rebuilds them after its second)."""
    ensure_world_of_one()
    index_of = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
    ddp_module = sys.modules[nn.parallel.DistributedDataParallel.__module__]
    saved = (dist._DEFAULT_FIRST_BUCKET_BYTES, getattr(ddp_module, "_sync_module_states", None))
    try:
        if first_bucket_bytes is not None:
            dist._DEFAULT_FIRST_BUCKET_BYTES = first_bucket_bytes
        if saved[1] is not None:
            # A world of one has nothing to sync, and 1.13's Gloo cannot
            # broadcast bfloat16.
            ddp_module._sync_module_states = lambda *a, **k: None
        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        if static_graph:
            kwargs["static_graph"] = True
        if cap_list is not None:
            kwargs["bucket_cap_mb_list"] = cap_list
        if skip_unused:
            kwargs["skip_all_reduce_unused_params"] = True
        ddp = nn.parallel.DistributedDataParallel(module, find_unused_parameters=find_unused, **kwargs)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved[0]
        if saved[1] is not None:
            ddp_module._sync_module_states = saved[1]
    seen = []

    def record(state, bucket):
        seen.append((bucket.index(), [index_of[id(p)] for p in bucket.parameters()]))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, record)
    per_iteration = []
    for _ in range(4):
        seen.clear()
        step(ddp).sum().backward()
        per_iteration.append([b for _, b in sorted(seen)])
    if iterations is not None:
        iterations.extend(per_iteration)
    if static_graph:  # the first two iterations alike (their order aside), rebuilt for the third
        # (with skip_unused the first one reduces every bucket: which
        # parameters go unused is known from the first on)
        assert skip_unused or sorted(per_iteration[0]) == sorted(per_iteration[1]), per_iteration
        assert per_iteration[2] == per_iteration[3], per_iteration
        return per_iteration[2]
    assert per_iteration[1] == per_iteration[2] == per_iteration[3], per_iteration  # rebuilt once
    if find_unused:  # never rebuilt: the constructor's buckets from the start
        assert per_iteration[0] == per_iteration[1], per_iteration
    return per_iteration[1]


@contextlib.contextmanager
def environment(**values):
    """os.environ with `values` set for the block (DDP's reducer reads its
    variables when it is made)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def export_layout(model, step, path, name="my-model"):
    """The README's export, word for word: the parameters and the order one
    backward makes their gradients ready."""
    import json
    params = list(model.named_parameters())
    # DDP gives a sparse embedding's gradient a bucket of its own
    sparse = {id(p) for m in model.modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
              for p in m.parameters(recurse=False)}
    ready = []  # the order backward makes the gradients ready
    hooks = [p.register_hook(lambda g, i=i: ready.append(i))
             for i, (n, p) in enumerate(params) if p.requires_grad]
    step(model).sum().backward()  # one backward, as a training step runs it
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    json.dump({"name": name,
               "tensors": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype),
                            "sparse": id(p) in sparse, "requires_grad": p.requires_grad}
                           for n, p in params],
               "ready_order": ready}, open(path, "w"))


def our_ddp_buckets(layout, cap_mb, first_mb, find_unused=False, ready_order=None, static_graph=False,
                    cap_list=None, skip_unused=False, first_iteration=False, set_last=False, env=None):
    """ddpdiag buckets' param_indices per bucket, for a layout in the object form
    (set_last: --set-last-bucket-cap; env: the environment to run it in)."""
    with tempfile.TemporaryDirectory() as d:
        model, out = os.path.join(d, "m.json"), os.path.join(d, "b.json")
        doc = {"name": "case", "tensors": layout}
        if ready_order is not None:
            doc["ready_order"] = ready_order
        with open(model, "w") as f:
            json.dump(doc, f)
        caps = (["--bucket-cap-mb", str(cap_mb), "--first-bucket-mb", str(first_mb)] if cap_list is None
                else ["--bucket-cap-mb-list", ",".join(repr(c) for c in cap_list)])
        p = run_bin(["buckets", "--model", model, "--json", out] + caps +
                    (["--find-unused-parameters"] if find_unused else []) +
                    (["--static-graph"] if static_graph else []) +
                    (["--skip-all-reduce-unused-params"] if skip_unused else []) +
                    (["--first-iteration"] if first_iteration else []) +
                    (["--set-last-bucket-cap"] if set_last else []), env=env)
        if p.returncode != 0:
            raise AssertionError(f"ddpdiag buckets exited {p.returncode}: {p.stderr}")
        with open(out) as f:
            # The buckets DDP all-reduces (with skip_unused not those marked skipped).
            return [b["param_indices"] for b in json.load(f)["results"]["buckets"] if not b["all_reduce_skipped"]]


def float_layout(rng, dtypes):
    return [{"name": f"layer{i}.weight", "shape": rng.choice([[rng.randint(1, 300)], [rng.randint(1, 40), rng.randint(1, 40)]]),
             "dtype": "torch." + rng.choice(dtypes)} for i in range(rng.choice([1, 2, 5, 12, 30]))]


def partly_frozen_case(rng, dtype_counts, frozen):
    """A random layout of some of four dtypes (a count from dtype_counts),
    each tensor frozen with probability `frozen` (never all), and a cap:
    (dtypes, layout, cap_bytes, explicit, first_mb), explicit saying whether
    bucket_cap_mb is passed, first_mb the first bucket that torch then uses
    (2.x: the cap; 1.13: 1 MiB)."""
    dtypes = rng.sample(["float32", "float16", "bfloat16", "float64"], rng.choice(dtype_counts))
    layout = float_layout(rng, dtypes)
    for t in layout:
        if rng.random() < frozen:
            t["requires_grad"] = False
    if all(t.get("requires_grad") is False for t in layout):
        layout[-1].pop("requires_grad")
    cap_bytes = rng.choice([64, 1000, 4096, 65536])
    explicit = rng.random() < 0.6
    first_mb = cap_bytes / MIB if explicit and TORCH_MAJOR >= 2 else 1
    return dtypes, layout, cap_bytes, explicit, first_mb


def random_forward(rng, layout, unused_share=(1, 3)):
    """A forward over a layout: in parameter order or (half the time)
    shuffled, leaving out up to unused_share (a fraction, as (num, den)) of
    the trainable parameters, never the first of them. Returns (forward,
    unused, ready): the order forward uses them, the set left out, and the
    order backward then makes the gradients ready (forward's reverse)."""
    forward = list(range(len(layout)))
    if rng.random() < 0.5:
        rng.shuffle(forward)
    trainable = [i for i in forward if layout[i].get("requires_grad", True)]
    num, den = unused_share
    unused = set(rng.sample(trainable[1:], rng.randint(0, num * len(trainable[1:]) // den))) if num else set()
    forward = [i for i in forward if i not in unused]
    ready = [i for i in reversed(forward) if layout[i].get("requires_grad", True)]
    return forward, unused, ready


class DdpAsRunTest(unittest.TestCase):
    """ddpdiag buckets against the buckets a real DistributedDataParallel
    reduces (Gloo, one rank, a comm hook recording each bucket)."""

    def test_random_layouts(self):
        rng = random.Random(31)
        for k in range(40 * SCALE):
            dtypes = rng.sample(["float32", "float16", "bfloat16", "float64"], rng.choice([1, 1, 2, 4]))
            layout = float_layout(rng, dtypes)
            cap_bytes = rng.choice([64, 1000, 4096, 65536])
            explicit = rng.random() < 0.6
            # torch 2.x caps the first bucket with an explicit bucket_cap_mb
            # too; 1.13 always with 1 MiB (README).
            first_mb = cap_bytes / MIB if explicit and TORCH_MAJOR >= 2 else 1
            theirs = ddp_buckets_as_run(layout, cap_bytes / MIB if explicit else None)
            ours = our_ddp_buckets(layout, repr(cap_bytes / MIB) if explicit else "25", repr(first_mb))
            with self.subTest(case=k, dtypes=dtypes, cap_bytes=cap_bytes, explicit=explicit):
                self.assertEqual(ours, theirs)
            bump("DDP runs compared" if len(dtypes) == 1 else "DDP runs of several dtypes compared")

    def test_frozen_parameters(self):
        # DDP reduces only parameters that require grad: a frozen one (a
        # fine-tuned model's backbone) is in no bucket. ddpdiag once bucketed
        # every tensor of the layout.
        rng = random.Random(32)
        for k in range(30 * SCALE):
            layout = float_layout(rng, rng.sample(["float32", "float16", "float64"], rng.choice([1, 2])))
            for t in layout:
                if rng.random() < 0.4:
                    t["requires_grad"] = False
            if all(t.get("requires_grad") is False for t in layout):
                layout[-1].pop("requires_grad")
            cap_bytes = rng.choice([64, 1000, 4096])
            theirs = ddp_buckets_as_run(layout, cap_bytes / MIB)
            ours = our_ddp_buckets(layout, repr(cap_bytes / MIB), repr(cap_bytes / MIB) if TORCH_MAJOR >= 2 else "1")
            with self.subTest(case=k):
                self.assertEqual(ours, theirs)
            bump("DDP runs compared")

    def test_find_unused_parameters_keeps_the_constructors_buckets(self):
        # With find_unused_parameters=True DDP never rebuilds its buckets:
        # it reduces those its constructor filled in parameter order,
        # reversed, whatever order the gradients arrive in. ddpdiag once
        # showed (and ddp-step ran) the rebuilt ones.
        rng = random.Random(33)
        for k in range(30 * SCALE):
            dtypes, layout, cap_bytes, explicit, first_mb = partly_frozen_case(rng, [1, 1, 2, 3], 0.2)
            # Half the cases run forward in a shuffled order, and the
            # layout says so (its ready_order): the buckets stay the same.
            forward = list(range(len(layout)))
            shuffled = rng.random() < 0.5
            if shuffled:
                rng.shuffle(forward)
            ready = [i for i in reversed(forward) if layout[i].get("requires_grad", True)]
            theirs = ddp_buckets_as_run(layout, cap_bytes / MIB if explicit else None,
                                        find_unused=True, forward_order=forward)
            ours = our_ddp_buckets(layout, repr(cap_bytes / MIB) if explicit else "25", repr(first_mb),
                                   find_unused=True, ready_order=ready if shuffled else None)
            with self.subTest(case=k, dtypes=dtypes, cap_bytes=cap_bytes, explicit=explicit):
                self.assertEqual(ours, theirs)
            bump("DDP runs with find_unused_parameters compared")
        # The mlp preset: parameter 0 alone under the 1 MiB first limit,
        # reduced last, as real DDP does it.
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "b.json")
            p = run_bin(["buckets", "--model", "mlp", "--find-unused-parameters", "--json", out])
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out) as f:
                results = json.load(f)["results"]
        self.assertEqual([b["param_indices"] for b in results["buckets"]], [[1, 2, 3, 4, 5], [0]])
        self.assertEqual((results["order"], results["find_unused_parameters"]), ("registration", True))

    def test_static_graph_rebuilds_with_the_unused_last(self):
        # With static_graph=True DDP rebuilds its buckets, find_unused_parameters
        # or not: from the order of its second iteration, the gradients that
        # arrived, then the parameters forward never used, by index.
        rng = random.Random(34)
        for k in range(30 * SCALE):
            dtypes, layout, cap_bytes, explicit, first_mb = partly_frozen_case(rng, [1, 1, 2], 0.15)
            # Up to a third of the trainable ones unused; at least one used.
            forward, unused, ready = random_forward(rng, layout)
            find_unused = rng.random() < 0.5
            theirs = ddp_buckets_as_run(layout, cap_bytes / MIB if explicit else None,
                                        find_unused=find_unused, forward_order=forward, static_graph=True)
            ours = our_ddp_buckets(layout, repr(cap_bytes / MIB) if explicit else "25", repr(first_mb),
                                   find_unused=find_unused, ready_order=ready, static_graph=True)
            with self.subTest(case=k, dtypes=dtypes, cap_bytes=cap_bytes, explicit=explicit,
                              unused=sorted(unused), find_unused=find_unused):
                self.assertEqual(ours, theirs)
            bump("DDP runs with static_graph compared")

    @unittest.skipUnless(HAS_CAP_LIST, "this torch's DDP has no bucket_cap_mb_list")
    def test_bucket_cap_mb_list(self):
        # torch 2.x's bucket_cap_mb_list: a limit a bucket, in order, the
        # last repeating, for the constructor's buckets and the rebuilt ones,
        # in place of bucket_cap_mb and the first bucket's 1 MiB. The first
        # iteration then reduces the constructor's buckets (not one bucket
        # per dtype), and the rebuilt ones hold the list as well.
        rng = random.Random(35)
        for k in range(30 * SCALE):
            dtypes, layout, _, _, _ = partly_frozen_case(rng, [1, 1, 2, 3], 0.15)
            # 1 to 4 caps around the tensors' sizes, a 0 now and then (torch
            # takes one, not all); as MiB the way a user writes them.
            caps = [rng.choice([0, 64, 300, 1000, 4096, 65536]) / MIB for _ in range(rng.randint(1, 4))]
            if max(caps) == 0:
                caps[-1] = 1000 / MIB
            mode = rng.choice(["rebuilt", "find_unused", "static_graph"])
            forward, unused, ready = random_forward(rng, layout, (0, 1) if mode == "rebuilt" else (1, 3))
            iterations = []
            theirs = ddp_buckets_as_run(layout, find_unused=mode == "find_unused", forward_order=forward,
                                        static_graph=mode == "static_graph", cap_list=caps, iterations=iterations)
            ours = our_ddp_buckets(layout, None, None, find_unused=mode == "find_unused", ready_order=ready,
                                   static_graph=mode == "static_graph", cap_list=caps)
            # The first iteration's buckets: the constructor's, with the list.
            constructor = our_ddp_buckets(layout, None, None, find_unused=True, ready_order=ready, cap_list=caps)
            with self.subTest(case=k, dtypes=dtypes, caps=caps, mode=mode, unused=sorted(unused)):
                self.assertEqual(ours, theirs)
                self.assertEqual(sorted(iterations[0]), sorted(constructor))
            bump(f"DDP runs with bucket_cap_mb_list compared ({mode})")

    @unittest.skipUnless(HAS_SKIP_UNUSED, "this torch's DDP has no skip_all_reduce_unused_params")
    def test_skip_all_reduce_unused_params(self):
        # torch 2.x's skip_all_reduce_unused_params: DDP issues no all_reduce
        # (calls no hook) for a bucket whose parameters are all unused;
        # `buckets --skip-all-reduce-unused-params` marks those.
        rng = random.Random(36)
        skipped_seen = 0
        for k in range(30 * SCALE):
            dtypes, layout, cap_bytes, explicit, first_mb = partly_frozen_case(rng, [1, 1, 2], 0.1)
            # Up to two thirds unused, at least one used: buckets of unused ones form.
            forward, unused, ready = random_forward(rng, layout, (2, 3))
            static = rng.random() < 0.5
            caps = None
            if HAS_CAP_LIST and rng.random() < 0.3:
                caps = [rng.choice([64, 300, 1000, 4096]) / MIB for _ in range(rng.randint(1, 3))]
            theirs = ddp_buckets_as_run(layout, cap_bytes / MIB if explicit and caps is None else None,
                                        find_unused=not static, forward_order=forward, static_graph=static,
                                        cap_list=caps, skip_unused=True)
            ours = our_ddp_buckets(layout, repr(cap_bytes / MIB) if explicit else "25", repr(first_mb),
                                   find_unused=not static, ready_order=ready, static_graph=static,
                                   cap_list=caps, skip_unused=True)
            every = our_ddp_buckets(layout, repr(cap_bytes / MIB) if explicit else "25", repr(first_mb),
                                    find_unused=not static, ready_order=ready, static_graph=static, cap_list=caps)
            skipped_seen += len(every) - len(ours)
            with self.subTest(case=k, dtypes=dtypes, cap_bytes=cap_bytes, explicit=explicit, caps=caps,
                              unused=sorted(unused), static=static):
                self.assertEqual(ours, theirs)
            bump("DDP runs with skip_all_reduce_unused_params compared")
        self.assertGreater(skipped_seen, 0)  # the cases do skip buckets
        bump("buckets skipped in those runs", skipped_seen)

    def test_first_iteration(self):
        # Before DDP rebuilds its buckets (its first iteration; the first two
        # with static_graph) it reduces its constructor's: one bucket per
        # dtype, or with find_unused_parameters (kept) or a torch 2.x
        # bucket_cap_mb_list those limits, in registration order reversed.
        rng = random.Random(37)
        for k in range(30 * SCALE):
            dtypes, layout, cap_bytes, explicit, first_mb = partly_frozen_case(rng, [1, 1, 2, 3], 0.15)
            mode = rng.choice(["rebuilt", "find_unused", "static_graph"])
            forward, unused, ready = random_forward(rng, layout, (0, 1) if mode == "rebuilt" else (1, 3))
            caps = None
            if HAS_CAP_LIST and rng.random() < 0.3:
                caps = [rng.choice([64, 300, 1000, 4096]) / MIB for _ in range(rng.randint(1, 3))]
            iterations = []
            ddp_buckets_as_run(layout, cap_bytes / MIB if explicit and caps is None else None,
                               find_unused=mode == "find_unused", forward_order=forward,
                               static_graph=mode == "static_graph", cap_list=caps, iterations=iterations)
            ours = our_ddp_buckets(layout, repr(cap_bytes / MIB) if explicit else "25", repr(first_mb),
                                   find_unused=mode == "find_unused", ready_order=ready,
                                   static_graph=mode == "static_graph", cap_list=caps, first_iteration=True)
            with self.subTest(case=k, dtypes=dtypes, cap_bytes=cap_bytes, explicit=explicit, caps=caps, mode=mode):
                if mode == "static_graph":
                    # its first iterations hand the buckets to the hook in another order
                    self.assertEqual(sorted(ours), sorted(iterations[0]))
                    self.assertEqual(sorted(ours), sorted(iterations[1]))
                else:
                    self.assertEqual(ours, iterations[0])
            bump(f"DDP first iterations compared ({mode})")

    def test_set_last_bucket_cap(self):
        # DDP_SET_LAST_BUCKET_CAP=1, which DDP's reducer reads (1.13 and
        # 2.x): the buckets it rebuilds are filled from the one reduced last,
        # which takes the first limit; the constructor's (find_unused_parameters
        # alone, the first iteration) are as without it. ddpdiag takes it as
        # --set-last-bucket-cap or from its own environment.
        rng = random.Random(38)
        changed = 0
        for k in range(30 * SCALE):
            dtypes, layout, cap_bytes, explicit, first_mb = partly_frozen_case(rng, [1, 1, 2, 3], 0.15)
            first_bytes = None
            if not explicit and rng.random() < 0.5:
                # the default cap with a small first bucket: the limit that moves
                first_bytes = rng.choice([0, 64, 300, 1000])
                first_mb = first_bytes / MIB
            mode = rng.choice(["rebuilt", "rebuilt", "find_unused", "static_graph"])
            forward, unused, ready = random_forward(rng, layout, (0, 1) if mode == "rebuilt" else (1, 3))
            caps = None
            if HAS_CAP_LIST and rng.random() < 0.3:
                caps = [rng.choice([64, 300, 1000, 4096]) / MIB for _ in range(rng.randint(1, 3))]
            iterations = []
            with environment(DDP_SET_LAST_BUCKET_CAP="1"):
                theirs = ddp_buckets_as_run(layout, cap_bytes / MIB if explicit and caps is None else None,
                                            first_bucket_bytes=first_bytes, find_unused=mode == "find_unused",
                                            forward_order=forward, static_graph=mode == "static_graph",
                                            cap_list=caps, iterations=iterations)
            args = dict(find_unused=mode == "find_unused", ready_order=ready, static_graph=mode == "static_graph",
                        cap_list=caps)
            cap_mb = repr(cap_bytes / MIB) if explicit else "25"
            ours = our_ddp_buckets(layout, cap_mb, repr(first_mb), set_last=True, **args)
            from_env = our_ddp_buckets(layout, cap_mb, repr(first_mb),
                                       env=dict(os.environ, DDP_SET_LAST_BUCKET_CAP="1"), **args)
            first = our_ddp_buckets(layout, cap_mb, repr(first_mb), set_last=True, first_iteration=True, **args)
            with self.subTest(case=k, dtypes=dtypes, cap_bytes=cap_bytes, explicit=explicit, first_bytes=first_bytes,
                              caps=caps, mode=mode, unused=sorted(unused)):
                self.assertEqual(ours, theirs)
                self.assertEqual(from_env, theirs)
                self.assertEqual(sorted(first), sorted(iterations[0]))
            changed += ours != our_ddp_buckets(layout, cap_mb, repr(first_mb), **args)
            bump(f"DDP runs with DDP_SET_LAST_BUCKET_CAP=1 compared ({mode})")
        self.assertGreater(changed, 0)  # the cases do move buckets
        bump("of those, runs whose buckets it changed", changed)
        # Only "1" turns it on, in torch and here.
        layout = [{"name": f"w{i}", "shape": [100], "dtype": "torch.float32"} for i in range(6)]
        for value in ["true", "0", ""]:
            with environment(DDP_SET_LAST_BUCKET_CAP=value):
                theirs = ddp_buckets_as_run(layout, 800 / MIB)
            ours = our_ddp_buckets(layout, repr(800 / MIB), repr(800 / MIB if TORCH_MAJOR >= 2 else 1),
                                   env=dict(os.environ, DDP_SET_LAST_BUCKET_CAP=value))
            with self.subTest(value=value):
                self.assertEqual(ours, theirs)
                self.assertEqual(ours, our_ddp_buckets(layout, repr(800 / MIB),
                                                       repr(800 / MIB if TORCH_MAJOR >= 2 else 1)))

    def test_a_model_with_an_unused_branch_exported_as_the_readme_says(self):
        # The README's export of a model whose forward skips a layer leaves
        # that layer out of ready_order. DDP runs it with
        # find_unused_parameters=True (buckets of its constructor) and stops
        # at its second iteration without it; ddpdiag refused the file even
        # with --find-unused-parameters.
        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(100, 100)
                self.head = nn.Linear(100, 10)
                self.aux = nn.Linear(100, 300)  # never used in forward

            def forward(self, x):
                return self.head(torch.relu(self.a(x)))

        torch.manual_seed(0)
        step = lambda m: m(torch.ones(2, 100))  # noqa: E731
        cap_mb = 0.05
        first_bytes = int(cap_mb * MIB) if TORCH_MAJOR >= 2 else None
        theirs = ddp_buckets_of(Branchy(), step, cap_mb, first_bytes, find_unused=True)
        self.assertEqual(sorted(i for b in theirs for i in b), list(range(6)))  # aux is bucketed
        with tempfile.TemporaryDirectory() as d:
            path, out = os.path.join(d, "m.json"), os.path.join(d, "b.json")
            export_layout(Branchy(), step, path)
            with open(path) as f:
                self.assertNotIn(4, json.load(f)["ready_order"])  # aux.weight got no gradient
            first_mb = repr(cap_mb) if TORCH_MAJOR >= 2 else "1"
            p = run_bin(["buckets", "--model", path, "--bucket-cap-mb", repr(cap_mb), "--first-bucket-mb",
                         first_mb, "--find-unused-parameters", "--json", out])
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out) as f:
                self.assertEqual([b["param_indices"] for b in json.load(f)["results"]["buckets"]], theirs)
            # Without find_unused_parameters DDP stops at its second step;
            # ddpdiag refuses, naming the parameters and the flag.
            with self.assertRaises(RuntimeError):
                ddp_buckets_of(Branchy(), step, cap_mb, first_bytes)
            p = run_bin(["buckets", "--model", path, "--bucket-cap-mb", repr(cap_mb)])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("4 ('aux.weight'), 5 ('aux.bias')", p.stderr)
            self.assertIn("--find-unused-parameters", p.stderr)
        bump("DDP runs compared", 2)

    def test_frozen_parameters_exported_as_the_readme_says(self):
        # The README's export line, with p.requires_grad as a fourth item.
        layout = [{"name": "0.weight", "shape": [512, 784], "dtype": "torch.float32", "requires_grad": False},
                  {"name": "0.bias", "shape": [512], "dtype": "torch.float32", "requires_grad": False},
                  {"name": "2.weight", "shape": [10, 512], "dtype": "torch.float32"},
                  {"name": "2.bias", "shape": [10], "dtype": "torch.float32"}]
        model = LayoutModule(layout)
        theirs = ddp_buckets_as_run(layout)
        self.assertEqual(theirs, [[3, 2]])
        with tempfile.TemporaryDirectory() as d:
            path, out = os.path.join(d, "m.json"), os.path.join(d, "b.json")
            with open(path, "w") as f:
                json.dump([(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()], f)
            p = run_bin(["buckets", "--model", path, "--json", out])
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out) as f:
                results = json.load(f)["results"]
            self.assertEqual([b["param_indices"] for b in results["buckets"]], theirs)
            self.assertEqual(results["frozen_tensor_count"], 2)
            self.assertEqual(results["gradient_bytes"], (10 * 512 + 10) * 4)
            # Nothing to reduce: torch refuses to wrap such a module.
            frozen = [dict(t, requires_grad=False) for t in layout]
            with self.assertRaises(RuntimeError):
                ddp_buckets_as_run(frozen)
            with open(path, "w") as f:
                json.dump({"name": "frozen", "tensors": frozen}, f)
            p = run_bin(["buckets", "--model", path])
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("requires grad", p.stderr)
        bump("DDP runs compared", 2)

    def test_zero_caps(self):
        layout = [{"name": f"l{i}", "shape": [n], "dtype": "torch.float32"}
                  for i, n in enumerate([300000, 10, 20, 400000, 5, 7])]
        ours = our_ddp_buckets(layout, "0", "1")
        self.assertEqual(ours, [[5, 4, 3], [2], [1], [0]])
        if TORCH_MAJOR < 2:
            # 1.13 takes bucket_cap_mb=0: one tensor a bucket after the first.
            self.assertEqual(ours, ddp_buckets_as_run(layout, bucket_cap_mb=0))
        else:
            # 2.x refuses it ("bucket_cap_mb should be set by now"); what
            # ddpdiag shows is 1.13's answer (README).
            with self.assertRaises(AssertionError):
                ddp_buckets_as_run(layout, bucket_cap_mb=0)
        # dist._DEFAULT_FIRST_BUCKET_BYTES = 0, both versions.
        self.assertEqual(our_ddp_buckets(layout, "25", "0"), ddp_buckets_as_run(layout, first_bucket_bytes=0))
        bump("DDP runs compared", 2)


# One rank of a real two-rank DDP (Gloo, file rendezvous), for RebuildTest:
# for each case, a module whose forward uses the parameters in this rank's
# order, the buckets a comm hook sees in each of four iterations.
REBUILD_WORKER = r"""
import json, sys
import torch, torch.distributed as dist, torch.nn as nn
rank, path, cases = int(sys.argv[1]), sys.argv[2], json.load(open(sys.argv[3]))
dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
out = []
for case in cases:
    params = [nn.Parameter(torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"].replace("torch.", ""))))
              for t in case["layout"]]
    module = nn.Module()
    for i, p in enumerate(params):
        module.register_parameter("p%d" % i, p)
    order = case["forward"][rank]
    def forward(x, order=order):
        for i in order:
            x = x + params[i].float().sum()
        return x
    module.forward = forward
    kwargs = {"bucket_cap_mb": case["cap_mb"], "static_graph": case["static_graph"]}
    ddp = nn.parallel.DistributedDataParallel(module, **kwargs)
    index_of = {id(p): i for i, p in enumerate(params)}
    seen = []
    def record(state, bucket):
        seen.append((bucket.index(), [index_of[id(p)] for p in bucket.parameters()]))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    ddp.register_comm_hook(None, record)
    iterations = []
    for _ in range(4):
        seen.clear()
        ddp(torch.zeros(1)).sum().backward()
        iterations.append([b for _, b in sorted(seen)])
    out.append(iterations)
    dist.barrier()
print(json.dumps(out))
"""


class RebuildTest(unittest.TestCase):
    """Two real DDP ranks whose backward makes the gradients ready in
    different orders: the buckets DDP rebuilds are rank 0's on both, the
    ones `ddpdiag buckets` gives for rank 0's order (ddpdiag's reducer,
    rebuilding, broadcasts rank 0's order likewise: its unit tests)."""

    def test_ranks_take_rank_0s_order(self):
        rng = random.Random(41)
        cases = []
        for _ in range(8 * SCALE):
            layout = float_layout(rng, rng.choice([["float32"], ["float32", "float64"]]))
            if len(layout) < 5:
                layout += float_layout(rng, ["float32"])[:5]
                for i, t in enumerate(layout):
                    t["name"] = f"layer{i}.weight"
            static = rng.random() < 0.3
            forward = []
            for _ in range(2):
                f = list(range(len(layout)))
                rng.shuffle(f)
                forward.append(f)
            cap_bytes = rng.choice([300, 1000, 4096])
            cases.append({"layout": layout, "forward": forward, "cap_mb": cap_bytes / MIB, "static_graph": static})
        with tempfile.TemporaryDirectory() as d:
            spec = os.path.join(d, "cases.json")
            with open(spec, "w") as f:
                json.dump(cases, f)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            procs = [subprocess.Popen([sys.executable, "-c", REBUILD_WORKER, str(r), os.path.join(d, "pg"), spec],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                     for r in range(2)]
            results = []
            for r, p in enumerate(procs):
                try:
                    out, err = p.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                    self.fail(f"torch rank {r} did not finish its DDP runs within 300 s")
                self.assertEqual(p.returncode, 0, f"torch rank {r}: {err[-2000:]}")
                results.append(json.loads(out.strip().splitlines()[-1]))
        differ = 0
        for k, case in enumerate(cases):
            first_rebuilt = 2 if case["static_graph"] else 1
            ready = [list(reversed(f)) for f in case["forward"]]
            cap = repr(case["cap_mb"])
            first = repr(case["cap_mb"] if TORCH_MAJOR >= 2 else 1)
            ours = our_ddp_buckets(case["layout"], cap, first, ready_order=ready[0], static_graph=case["static_graph"])
            ours_rank1 = our_ddp_buckets(case["layout"], cap, first, ready_order=ready[1],
                                         static_graph=case["static_graph"])
            with self.subTest(case=k, static_graph=case["static_graph"], cap_mb=case["cap_mb"]):
                for it in range(first_rebuilt, 4):
                    self.assertEqual(results[0][k][it], ours, f"rank 0, iteration {it}")
                    self.assertEqual(results[1][k][it], ours, f"rank 1, iteration {it}")
            differ += ours != ours_rank1
            bump("two-rank DDP rebuilds compared (each rank its own gradient order)")
        self.assertGreater(differ, 0)  # rank 1's own order would give other buckets
        bump("of those, where rank 1's own order would give other buckets", differ)


class ReadyOrderTest(unittest.TestCase):
    """Real modules, whose backward does not walk the parameters exactly in
    reverse (a norm layer's weight gradient is ready before its bias's),
    exported as the README says, against the buckets DDP reduces."""

    @staticmethod
    def conv_net():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 16, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
        x = torch.randn(2, 3, 10, 10)
        return m, lambda mod: mod(x)

    @staticmethod
    def transformer():
        torch.manual_seed(0)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(50, 32)
                self.pos = nn.Embedding(8, 32)
                self.ln0 = nn.LayerNorm(32)
                self.block = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0)
                self.ln_f = nn.LayerNorm(32)
                self.head = nn.Linear(32, 7)

            def forward(self, ids):
                h = self.ln0(self.emb(ids) + self.pos(torch.arange(ids.shape[1])))
                return self.head(self.ln_f(self.block(h)))

        ids = torch.randint(0, 50, (8, 2))
        return Net(), lambda mod: mod(ids)

    @staticmethod
    def sparse_net():
        # Sparse embeddings: DDP gives each sparse gradient a bucket of its
        # own; an export without the flag got the buckets wrong.
        torch.manual_seed(0)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.big = nn.Embedding(1000, 16, sparse=True)
                self.fc1 = nn.Linear(16, 16)
                self.small = nn.Embedding(20, 16, sparse=True)
                self.fc2 = nn.Linear(16, 4)

            def forward(self, ids):
                return self.fc2(self.fc1(self.big(ids)) + self.small(ids % 20))

        ids = torch.randint(0, 1000, (4, 3))
        return Net(), lambda mod: mod(ids)

    def test_exported_modules_match_ddp(self):
        for build in (self.conv_net, self.transformer, self.sparse_net):
            for cap_bytes in (1, 600, 2000, 9000, 40000):
                model, step = build()
                with tempfile.TemporaryDirectory() as d:
                    path = os.path.join(d, "m.json")
                    export_layout(model, step, path)
                    with open(path) as f:
                        exported = json.load(f)
                    theirs = ddp_buckets_of(model, step, cap_bytes / MIB)
                    first_mb = repr(cap_bytes / MIB) if TORCH_MAJOR >= 2 else "1"
                    args = ["buckets", "--model", path, "--bucket-cap-mb", repr(cap_bytes / MIB),
                            "--first-bucket-mb", first_mb, "--json", os.path.join(d, "b.json")]
                    p = run_bin(args)
                    self.assertEqual(p.returncode, 0, p.stderr)
                    with open(os.path.join(d, "b.json")) as f:
                        results = json.load(f)["results"]
                    with self.subTest(model=build.__name__, cap_bytes=cap_bytes):
                        self.assertEqual(results["ready_order"], "recorded")
                        self.assertEqual([b["param_indices"] for b in results["buckets"]], theirs)
                    # The same layout without its ready order assumes the
                    # exact reverse, which is not what backward does here.
                    del exported["ready_order"]
                    with open(path, "w") as f:
                        json.dump(exported, f)
                    p = run_bin(args)
                    self.assertEqual(p.returncode, 0, p.stderr)
                    with open(os.path.join(d, "b.json")) as f:
                        plain = json.load(f)["results"]
                    self.assertEqual(plain["ready_order"], "reverse")
                    reverse_matches = [b["param_indices"] for b in plain["buckets"]] == theirs
                if build != self.sparse_net:
                    self.assertFalse(reverse_matches and cap_bytes == 1,
                                     (build.__name__, "reverse order matched"))
                bump("exported modules compared with DDP")


# ------------------------------------------------- memory vs DDP's allocations


class SparseModule(nn.Module):
    """nn.Embedding(sparse=True) then a Linear without bias: the layout
    [emb (rows, dim) sparse, fc (10, dim)]."""

    def __init__(self, rows, dim):
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=True)
        self.fc = nn.Linear(dim, 10, bias=False)

    def forward(self, x):
        return self.fc(self.emb(x))


def torch_ddp_memory(module, inputs, bucket_cap_mb, views, **ddp_kwargs):
    """What a real DistributedDataParallel (Gloo, one rank) holds from its
    second iteration on, per ddpdiag memory's categories: parameters (every
    parameter's bytes, frozen ones included), buckets (the flat buffers of
    its dense buckets, seen by a comm hook; a sparse bucket has none: its
    buffer() is the sparse gradient itself), gradients (the bytes of dense
    gradients that do not alias a bucket buffer: with gradient_as_bucket_view
    none) and the bucket count."""
    ensure_world_of_one()
    ddp_module = sys.modules[nn.parallel.DistributedDataParallel.__module__]
    saved = getattr(ddp_module, "_sync_module_states", None)
    try:
        if saved is not None:
            ddp_module._sync_module_states = lambda *a, **k: None  # world of one; 1.13 Gloo has no bf16 broadcast
        # A list is torch 2.x's bucket_cap_mb_list.
        kwargs = ({} if bucket_cap_mb is None else
                  {"bucket_cap_mb_list": bucket_cap_mb} if isinstance(bucket_cap_mb, list) else
                  {"bucket_cap_mb": bucket_cap_mb})
        ddp = nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=views, **kwargs, **ddp_kwargs)
    finally:
        if saved is not None:
            ddp_module._sync_module_states = saved
    buffers = {}

    def record(state, bucket):
        b = bucket.buffer()
        buffers[bucket.index()] = None if b.is_sparse else (b.data_ptr(), b.numel() * b.element_size())
        fut = torch.futures.Future()
        fut.set_result(b)
        return fut

    ddp.register_comm_hook(None, record)
    for _ in range(3):  # rebuilt at the second, fixed from then on
        buffers.clear()
        ddp(inputs).sum().backward()
    dense = [v for v in buffers.values() if v is not None]
    own = 0
    for q in module.parameters():
        if q.grad is None or q.grad.is_sparse:
            continue
        if not any(a <= q.grad.data_ptr() < a + n for a, n in dense):
            own += q.grad.numel() * q.grad.element_size()
    return {"parameters": sum(q.numel() * q.element_size() for q in module.parameters()),
            "buckets": sum(n for _, n in dense), "gradients": own, "bucket_count": len(buffers)}


def our_memory(model, bucket_cap_mb, views, nproc=1, ready_order=None, extra=()):
    """ddpdiag memory's figures of rank 0 (they are the same on every rank).
    bucket_cap_mb None: the defaults; otherwise the README's way to model
    torch's DDP(bucket_cap_mb=X): 2.x caps the first bucket at X too.
    ready_order goes into the layout; extra are more flags."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "m.json")
        if not isinstance(model, str):
            path = os.path.join(d, "layout.json")
            doc = {"name": "case", "tensors": model}
            if ready_order is not None:
                doc["ready_order"] = ready_order
            with open(path, "w") as f:
                json.dump(doc, f)
            model = path
        args = ["memory", "--model", model, "--nproc", str(nproc), "--no-comm-probe", "--json", out] + list(extra)
        if isinstance(bucket_cap_mb, list):
            args += ["--bucket-cap-mb-list", ",".join(repr(c) for c in bucket_cap_mb)]
        elif bucket_cap_mb is not None:
            args += ["--bucket-cap-mb", repr(bucket_cap_mb),
                     "--first-bucket-mb", repr(bucket_cap_mb if TORCH_MAJOR >= 2 else 1.0)]
        # DDP's default is gradient_as_bucket_view=False, as ddpdiag's.
        args.append("--gradient-as-bucket-view" if views else "--no-gradient-views")
        p = run_bin(args)
        if p.returncode != 0:
            raise AssertionError(f"ddpdiag {' '.join(args)} exited {p.returncode}: {p.stderr}")
        with open(out) as f:
            results = json.load(f)["results"]
    ranks = results["ranks"]
    for r in ranks:
        assert r["categories"] == ranks[0]["categories"], ranks
    c = ranks[0]["categories"]
    return {"parameters": c["parameters"], "buckets": c["buckets"], "gradients": c["gradients"],
            "bucket_count": results["bucket_count"]}, ranks[0]


class MemoryTest(unittest.TestCase):
    """ddpdiag memory's parameters, buckets and gradients against what a real
    DDP allocates for the same layout, caps and gradient_as_bucket_view."""

    def test_layouts(self):
        # Mixed dtypes, frozen parameters, caps that split, views on and off.
        # ddpdiag memory once had no --first-bucket-mb, so a torch 2.x job
        # with DDP(bucket_cap_mb=X) (first bucket X as well) could not be
        # modelled: its bucket count was off (4 vs 6 here at 0.05 MiB).
        rng = random.Random(41)
        layouts = [[{"name": "a", "shape": [300, 300], "dtype": "torch.float16"},
                    {"name": "b", "shape": [300], "dtype": "torch.float32"},
                    {"name": "c", "shape": [100, 70], "dtype": "torch.bfloat16"},
                    {"name": "d", "shape": [64, 64], "dtype": "torch.float64", "requires_grad": False},
                    {"name": "e", "shape": [1000], "dtype": "torch.float64"}]]
        for _ in range(3 * SCALE):
            layout = [{"name": f"l{i}.weight", "shape": [rng.randint(1, 400), rng.randint(1, 400)],
                       "dtype": "torch." + rng.choice(["float32", "float16", "bfloat16", "float64"]),
                       "requires_grad": rng.random() > 0.2} for i in range(rng.randint(2, 12))]
            layout[0]["requires_grad"] = True
            layouts.append(layout)
        # torch 2.x's bucket_cap_mb_list too, where DDP has it.
        lists = [[0.01, 0.3, 0.05]] if HAS_CAP_LIST else []
        for k, layout in enumerate(layouts):
            for cap in [None, 0.05, 1.0] + lists:
                for views in [True, False]:
                    theirs = torch_ddp_memory(LayoutModule(layout), torch.zeros(1), cap, views)
                    ours, _ = our_memory(layout, cap, views)
                    with self.subTest(case=k, cap=cap, views=views):
                        self.assertEqual(ours, theirs)
                    bump("memory figures compared")

    def test_unused_parameters_have_no_gradient(self):
        # With find_unused_parameters or static_graph, a parameter forward
        # never uses gets no .grad in torch (None, views or not); ddpdiag
        # memory once counted a gradient buffer for it without views.
        rng = random.Random(42)
        for k in range(4 * SCALE):
            layout = [{"name": f"l{i}.weight", "shape": [rng.randint(1, 300), rng.randint(1, 300)],
                       "dtype": "torch." + rng.choice(["float32", "float16", "float64"]),
                       "requires_grad": rng.random() > 0.15} for i in range(rng.randint(3, 10))]
            layout[0]["requires_grad"] = True
            layout[-1]["requires_grad"] = True
            forward, unused, ready = random_forward(rng, layout, (1, 2))
            if not unused:  # at least one: the last
                unused = {len(layout) - 1}
                forward = [i for i in forward if i not in unused]
                ready = [i for i in reversed(forward) if layout[i].get("requires_grad", True)]
            for setting in ["find_unused_parameters", "static_graph"]:
                for views in [False, True]:
                    theirs = torch_ddp_memory(LayoutModule(layout, forward), torch.zeros(1), 0.05, views,
                                              **{setting: True})
                    ours, _ = our_memory(layout, 0.05, views, ready_order=ready,
                                         extra=["--find-unused-parameters" if setting == "find_unused_parameters"
                                                else "--static-graph"])
                    with self.subTest(case=k, setting=setting, views=views, unused=sorted(unused)):
                        self.assertEqual(ours, theirs)
                    bump("memory figures with unused parameters compared")

    def test_presets(self):
        for model in ["mlp", "resnet50"]:
            for cap, views in [(None, True), (None, False), (5.0, True)]:
                theirs = torch_ddp_memory(LayoutModule(dump_layout(model)), torch.zeros(1), cap, views)
                ours, _ = our_memory(model, cap, views)
                with self.subTest(model=model, cap=cap, views=views):
                    self.assertEqual(ours, theirs)
                bump("memory figures compared")

    def test_sparse_bucket_has_no_buffer(self):
        # DDP gives an nn.Embedding(sparse=True) a bucket of its own with no
        # flat buffer. ddpdiag memory once counted the sparse bucket's nnz
        # buffers as buckets (2576 B, not torch's 2560 on one rank) and its
        # rows/values staging as workspace; both are communication. The
        # sparse gradient's own bytes depend on the rows touched and are not
        # compared.
        layout = [{"name": "emb.weight", "shape": [10000, 64], "sparse": True},
                  {"name": "fc.weight", "shape": [10, 64]}]
        for views in [True, False]:
            theirs = torch_ddp_memory(SparseModule(10000, 64), torch.arange(512), None, views)
            for nproc in [1, 2]:
                ours, rank0 = our_memory(layout, None, views, nproc)
                with self.subTest(views=views, nproc=nproc):
                    self.assertEqual(ours, theirs)
                    self.assertEqual(rank0["categories"]["workspace"], MIB)  # --workspace-mb 1, nothing else
                    self.assertGreater(rank0["categories"]["communication_buffers"], 0)
                bump("memory figures compared")


# ---------------------------------------------------------------- sampler


def torch_sampler(n, r, rank, seed, epoch, shuffle, drop_last):
    s = DistributedSampler(range(n), num_replicas=r, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    return list(iter(s))


def our_sampler(n, r, rank, seed, epoch, shuffle, drop_last, extra=()):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "s.json")
        args = ["sampler", "--dataset-size", str(n), "--world-size", str(r), "--rank", str(rank),
                f"--seed={seed}", "--epoch", str(epoch), "--torch-version", TORCH_VERSION_FLAG,
                "--json", out, "--count-only"]
        if drop_last:
            args.append("--drop-last")
        if not shuffle:
            args.append("--no-shuffle")
        args += list(extra)
        p = run_bin(args)
        if p.returncode != 0:
            return p.returncode, p.stderr
        with open(out) as f:
            return 0, json.load(f)["results"]


def random_seed(rng):
    kind = rng.random()
    if kind < 0.4:
        return rng.randint(0, 1000)
    if kind < 0.6:
        return rng.randint(-(2 ** 63), -1)
    if kind < 0.8:
        return rng.randint(2 ** 32, 2 ** 64 - 100)
    return rng.randint(0, 2 ** 32 - 1)


class SamplerTest(unittest.TestCase):
    def test_random_cases(self):
        rng = random.Random(7)
        for k in range(250 * SCALE):
            n = rng.choice([0, 1, 2, 3, 5, 10, 17, 100, rng.randint(0, 5000), rng.randint(0, 100000)])
            r = rng.choice([1, 2, 3, 4, 7, 8, 16, 33])
            rank = rng.randrange(r)
            seed, epoch = random_seed(rng), rng.randint(0, 20)
            shuffle, drop_last = rng.random() < 0.8, rng.random() < 0.5
            expected = torch_sampler(n, r, rank, seed, epoch, shuffle, drop_last)
            rc, got = our_sampler(n, r, rank, seed, epoch, shuffle, drop_last)
            with self.subTest(case=k, n=n, r=r, rank=rank, seed=seed, epoch=epoch, shuffle=shuffle,
                              drop_last=drop_last):
                self.assertEqual(rc, 0, got)
                self.assertEqual(got["indices"], expected)
                self.assertEqual(got["num_samples"], len(expected))
            bump("sampler cases")
            if len(expected) > 4 and k % 5 == 0:
                start = rng.randrange(len(expected))
                count = rng.randint(0, len(expected) - start)
                rc, part = our_sampler(n, r, rank, seed, epoch, shuffle, drop_last,
                                       ["--start", str(start), "--count", str(count)])
                self.assertEqual(rc, 0, part)
                self.assertEqual(part["indices"], expected[start:start + count])
                bump("sampler range cases")

    def test_large_dataset(self):
        # One case past the L2-cache sizes, with padding.
        n, r = 3_000_017, 8
        for rank in (0, 7):
            expected = torch_sampler(n, r, rank, 1234, 5, True, False)
            rc, got = our_sampler(n, r, rank, 1234, 5, True, False)
            self.assertEqual(rc, 0, got)
            self.assertEqual(got["indices"], expected)
            bump("sampler cases")

    def test_seed_overflow_is_a_usage_error(self):
        # 1.13 raises OverflowError, 2.x ValueError ("Overflow when unpacking").
        with self.assertRaises((OverflowError, RuntimeError, ValueError)):
            torch_sampler(10, 2, 0, 2 ** 64 - 1, 1, True, False)
        rc, err = our_sampler(10, 2, 0, 2 ** 64 - 1, 1, True, False)
        self.assertEqual(rc, 2)
        self.assertIn("seed", err)
        with self.assertRaises(ValueError):
            torch_sampler(10, 2, 2, 0, 0, True, False)
        rc, err = our_sampler(10, 2, 2, 0, 0, True, False)
        self.assertEqual(rc, 2)
        self.assertIn("rank 2", err)

    def test_epoch_is_any_python_int(self):
        # set_epoch takes any Python int; only seed + epoch must fit
        # manual_seed. An epoch beyond int64 was once clamped by the CLI to
        # 2^63 - 1 without a word: --epoch 9223372036854775808 gave the
        # indices of epoch 2^63 - 1, and an epoch torch overflows on gave
        # indices instead of an error.
        for seed, epoch in [(0, 2 ** 63), (-(2 ** 63), 2 ** 64 - 1), (2 ** 70, 3 - 2 ** 70),
                            (2 ** 64 - 1, 0), (5, -(2 ** 63) - 5), (-1, 2 ** 63)]:
            for n, r, rank, drop_last in [(10, 2, 0, False), (1001, 7, 6, True)]:
                expected = torch_sampler(n, r, rank, seed, epoch, True, drop_last)
                rc, got = our_sampler(n, r, rank, seed, epoch, True, drop_last)
                with self.subTest(seed=seed, epoch=epoch, n=n):
                    self.assertEqual(rc, 0, got)
                    self.assertEqual(got["indices"], expected)
                bump("sampler cases")
        # Beyond 64 bits, the report holds its digits as a string (as for
        # the seed), so the run can be told again, and still validates.
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "s.json")
            p = run_bin(["sampler", "--dataset-size", "10", "--world-size", "2", "--rank", "0",
                         f"--seed={2 ** 70}", f"--epoch={3 - 2 ** 70}", "--json", out, "--count-only"])
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out) as f:
                res = json.load(f)["results"]
                self.assertEqual(res["epoch"], str(3 - 2 ** 70))
                self.assertEqual(res["seed"], str(2 ** 70))
            p = run_bin(["report", "validate", out])
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # The last two: 37 and 38 digits each, whose sum must not overflow
        # the parser's 128-bit integer on the way to the range check.
        for seed, epoch in [(0, 99999999999999999999), (0, -(2 ** 63) - 1), (2 ** 63, 2 ** 63),
                            (10 ** 37 - 1, 10 ** 37 - 1), (10 ** 38 - 1, 10 ** 38 - 1)]:
            with self.assertRaises((OverflowError, RuntimeError, ValueError)):
                torch_sampler(10, 2, 0, seed, epoch, True, False)
            rc, err = our_sampler(10, 2, 0, seed, epoch, True, False)
            with self.subTest(seed=seed, epoch=epoch):
                self.assertEqual(rc, 2, err)
                self.assertIn("seed + epoch", err)

    def test_no_shuffle_never_seeds(self):
        # shuffle=False never calls manual_seed, so torch takes any seed and
        # epoch there; ddpdiag once refused them (exit 2), in both modes.
        # Any length: 10^40 and -10^45 were once refused for their length.
        for seed, epoch in [(2 ** 64 - 1, 1), (-(2 ** 63), -1), (2 ** 64 - 1, 40), (10 ** 40, -(10 ** 45))]:
            for n, r, rank, drop_last in [(10, 2, 1, False), (2622, 1024, 403, True), (50, 1000, 215, False)]:
                expected = torch_sampler(n, r, rank, seed, epoch, False, drop_last)
                for extra in ([], ["--streaming"]):
                    rc, got = our_sampler(n, r, rank, seed, epoch, False, drop_last, extra)
                    with self.subTest(seed=seed, epoch=epoch, n=n, extra=extra):
                        self.assertEqual(rc, 0, got)
                        self.assertEqual(got["indices"], expected)
                    bump("sampler cases")

    def test_randperm(self):
        rng = random.Random(99)
        self.assertEqual(torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist(),
                         [4, 1, 7, 5, 3, 9, 0, 8, 6, 2])
        for k in range(150 * SCALE):
            n = rng.choice([0, 1, 2, 10, rng.randint(0, 1000), rng.randint(0, 200000)])
            seed = random_seed(rng)
            expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
            rc, got = our_sampler(n, 1, 0, seed, 0, True, False)
            with self.subTest(case=k, n=n, seed=seed):
                self.assertEqual(rc, 0, got)
                self.assertEqual(got["indices"], expected)
            bump("randperm cases")

    @unittest.skipUnless(TORCH_MAJOR >= 2 and os.environ.get("DDPDIAG_COMPAT_LARGE") == "1",
                         "torch 2.x large-n randperm: set DDPDIAG_COMPAT_LARGE=1 (1.7 GB, ~1 min)")
    def test_randperm_large_n_branch(self):
        # Both sides of the threshold: the last n of the swap algorithm and the
        # first n of the inside-out one. Compared on a strided sample (every
        # 1000th position, from two offsets) to keep the transfer small.
        for n in (214_748_363, 214_748_364):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(5))
            for rank in (0, 777):
                rc, got = our_sampler(n, 1000, rank, 5, 0, True, False)
                self.assertEqual(rc, 0, got)
                # DistributedSampler's padding: position p holds perm[p % n].
                total = -(-n // 1000) * 1000
                expected = perm[torch.arange(rank, total, 1000) % n].tolist()
                self.assertEqual(got["indices"], expected, f"n={n} rank={rank}")
                bump("large-n randperm samples")
            del perm


# ------------------------------------------------------ broadcast chunks


_TRACER = None


def broadcast_tracer():
    """A process group that records what each broadcast carries, over a Gloo
    group of one (a world of one is all torch needs to run
    _broadcast_coalesced). C++ calls into it: _broadcast_coalesced groups the
    tensors itself and calls broadcast() once per group, flattened."""
    global _TRACER
    if _TRACER is None:
        ensure_world_of_one()
        inner = dist.distributed_c10d._get_default_group()

        class Tracing(dist.ProcessGroup):
            def __init__(self):
                super().__init__(0, 1)
                self.calls = []

            def broadcast(self, tensors, opts):
                self.calls.append([(str(t.dtype), t.numel() * t.element_size()) for t in tensors])
                # As bytes: 1.13's Gloo has no bfloat16 (each group is flat).
                return inner.broadcast([t.view(torch.uint8) for t in tensors], opts)

            def getBackendName(self):
                return "tracing"

        _TRACER = Tracing()
    return _TRACER


def torch_broadcast_chunks(layout, cap_bytes):
    """[(dtype, bytes)] of each broadcast of DDP's initial sync, in order."""
    pg = broadcast_tracer()
    tensors = [torch.zeros(t["shape"], dtype=DTYPES[t["dtype"].replace("torch.", "")]) for t in layout]
    pg.calls = []
    dist._broadcast_coalesced(pg, tensors, cap_bytes, 0)
    out = []
    for call in pg.calls:
        assert len(call) == 1, call  # one flattened tensor per group
        out.append(call[0])
    return out


def random_layout(rng):
    n = rng.choice([1, 2, 3, 5, 8, 20, 40])
    dtypes = rng.sample(list(DTYPES), rng.choice([1, 1, 2, 3, 5]))
    layout = []
    for i in range(n):
        shape = rng.choice([[], [0], [rng.randint(1, 300)], [rng.randint(1, 40), rng.randint(1, 40)]])
        layout.append({"name": f"t{i}", "shape": shape, "dtype": "torch." + rng.choice(dtypes)})
    return layout


class BroadcastChunksTest(unittest.TestCase):
    """broadcast-test's chunks (results.rows[].chunk_list) against the
    broadcasts torch's _broadcast_coalesced makes for the same tensors, as
    DDP's _sync_module_states calls it, dtype and bytes per broadcast."""

    def compare(self, layout, caps, model):
        with tempfile.TemporaryDirectory() as d:
            if model is None:
                model = os.path.join(d, "layout.json")
                with open(model, "w") as f:
                    json.dump({"name": "case", "tensors": layout}, f)
            out = os.path.join(d, "b.json")
            # A cap in MiB whose bytes are exact (a multiple of 16 B is a
            # short binary fraction of a MiB).
            p = run_bin(["broadcast-test", "--nproc", "1", "--model", model, "--chunk-mb",
                         ",".join(repr(c / MIB) for c in caps), "-n", "1", "-w", "0", "--json", out])
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out) as f:
                rows = json.load(f)["results"]["rows"]
        self.assertEqual(len(rows), len(caps))
        for cap, row in zip(caps, rows):
            self.assertEqual(row["chunk_bytes"], cap)
            ours = [(c["dtype"], c["bytes"]) for c in row["chunk_list"]]
            self.assertEqual(ours, torch_broadcast_chunks(layout, cap), f"cap {cap}: {layout}")
            self.assertEqual(row["chunks"], len(ours))
            # Every tensor once; each chunk's tensors add up to its bytes.
            seen = sorted(i for c in row["chunk_list"] for i in c["tensors"])
            self.assertEqual(seen, list(range(len(layout))))
            bump("broadcast chunk lists")

    def test_presets(self):
        for model in ["mlp", "resnet50"]:
            with self.subTest(model=model):
                self.compare(dump_layout(model), [250 * MIB, 25 * MIB, 16 * MIB, MIB, 256 * 1024], model)

    def test_random_layouts(self):
        rng = random.Random(8)
        for k in range(40 * SCALE):
            layout = random_layout(rng)
            # DDP (and broadcast-test) refuse a module without a trainable
            # parameter: an integer-only layout gets one float tensor.
            if not any(DTYPES[t["dtype"][len("torch."):]].is_floating_point for t in layout):
                layout[-1]["dtype"] = "torch.float32"
            caps = sorted({rng.choice([16, 64, 400, 1024, 4096, 65536]) for _ in range(3)})
            with self.subTest(case=k):
                self.compare(layout, caps, None)


if __name__ == "__main__":
    print(f"torch {torch.__version__} ({TORCH_VERSION_FLAG}), ddpdiag {BIN}")
    prog = unittest.main(exit=False, verbosity=2)
    for key, n in sorted(STATS.items()):
        print(f"compared: {n} {key}")
    sys.exit(0 if prog.result.wasSuccessful() else 1)
