"""Per-sample gradients of the LoRA pairs, pairwise (or flat) clipping and noising (RLDP Eq. 3-6).

Per-sample gradients: PEFT's LoRA ``A`` and ``B`` are plain bias-free ``nn.Linear`` layers, whose exact
per-sample gradients (Opacus's rule for linear layers) :class:`PerSampleGradientComputer` computes from one hook
per matrix; frozen weights get none. Clipping and noise are ours too, because the noise calibration must follow
the clip vector at every step (ERRATA E1: Opacus's per-layer optimizer fixes ||C||_2 at construction).

Clip groups: ``pairwise`` clips each pair ``(A_i, B_i)`` jointly to its own radius C_i (Eq. 4-5);
``flat`` clips the concatenation of all LoRA gradients to one radius C (vanilla DP-SGD on LoRA).

Layout: the per-sample gradients of all pairs are ONE ``[batch, D]`` matrix, pair by pair (A_0, B_0, A_1,
B_1, ...: :func:`raydp.privacy.mechanism.flatten_pairs`'s order), and every stage after the hooks (zeroing
non-finite units, summing a unit's records, pair norms, clip factors, the clipped sum, noise) is a few
whole-matrix operations whatever the number of pairs: on a GPU the step is not bound by kernel launches
per pair, and nothing in it waits for the device.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import warnings
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from raydp.model.adapters import AdapterPair
from raydp.model.loss import per_sequence_nll
from raydp.privacy.mechanism import CLIP, CLIP_EPS, flatten_pairs  # noqa: F401  (CLIP_EPS: Eq. 5's stabiliser)

CLIP_MODES = ("pairwise", "flat")


@dataclass(frozen=True)
class PairLayout:
    """Where each pair's A and B sit in a flattened gradient (A_0, B_0, A_1, B_1, ...)."""

    shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (shape of A_i, shape of B_i) per pair

    @classmethod
    def of(cls, a, b, batched: bool) -> "PairLayout":
        cut = 1 if batched else 0
        return cls(tuple((tuple(ta.shape[cut:]), tuple(tb.shape[cut:])) for ta, tb in zip(a, b)))

    @property
    def n_pairs(self) -> int:
        return len(self.shapes)

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Entries of each pair (A and B together)."""
        return tuple(int(np.prod(sa)) + int(np.prod(sb)) for sa, sb in self.shapes)

    @property
    def dim(self) -> int:
        return sum(self.sizes)

    def pair_of_column(self, device: torch.device) -> torch.Tensor:
        """The pair index of each of the D columns (cached per device)."""
        cache = self.__dict__.setdefault("_columns", {})
        key = str(device)
        if key not in cache:
            cache[key] = torch.from_numpy(np.repeat(np.arange(self.n_pairs), self.sizes)).to(device)
        return cache[key]

    @cached_property
    def _parts(self) -> tuple[list[int], list[tuple[int, ...]]]:
        """Entries and shape of each matrix in flattened order (A_0, B_0, A_1, B_1, ...)."""
        shapes = [shape for pair in self.shapes for shape in pair]
        return [int(np.prod(shape)) for shape in shapes], shapes

    def split(self, flat: torch.Tensor, batched: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of ``flat`` (``[batch, D]`` or ``[D]``) as the A and B tensors of each pair (no copy)."""
        sizes, shapes = self._parts
        lead = (flat.shape[0],) if batched else ()
        views = [chunk.view(*lead, *shape) for chunk, shape in zip(flat.split(sizes, dim=-1), shapes)]
        return views[0::2], views[1::2]

    @cached_property
    def period(self) -> int:
        """The smallest p such that the pair sizes repeat every p pairs (1: all pairs the same size, as GPT-2's
        c_attn adapters; 2: Llama's q_proj / v_proj alternating; n_pairs at worst)."""
        sizes, n = self.sizes, self.n_pairs
        return next(p for p in range(1, n + 1) if n % p == 0 and all(sizes[i] == sizes[i % p] for i in range(n)))

    def segment_norms(self, flat: torch.Tensor) -> torch.Tensor:
        """L2 norm of each pair's segment of ``flat`` ([batch, D] -> [batch, n_pairs]; [D] -> [n_pairs]).

        The squares are summed in float64: the result, rounded once to ``flat``'s dtype, is within float32 rounding
        of the exact norm, which the noise margin covers. The sums are plain reductions over views, ``period`` of
        them (one for equal pairs): an ``index_add_`` into n_pairs outputs made every column an atomic add on one of
        a few addresses, milliseconds per step on a GPU at GPT-2 small's shape."""
        squares = flat.detach().double().pow(2)
        lead = squares.shape[:-1]
        if self.n_pairs == 0:
            return squares.new_zeros((*lead, 0)).to(flat.dtype)
        p = self.period
        block = squares.reshape(*lead, self.n_pairs // p, sum(self.sizes[:p]))  # [..., repeats, one period]
        parts, at = [], 0
        for size in self.sizes[:p]:
            parts.append(block[..., at:at + size].sum(-1))  # [..., repeats]: pair r * p + j for slot j
            at += size
        sums = parts[0] if p == 1 else torch.stack(parts, dim=-1).reshape(*lead, self.n_pairs)
        return sums.sqrt().to(flat.dtype)


@dataclass
class PerSampleGrads:
    """Per-sample gradients of every pair as one ``[batch, D]`` matrix (module docstring), and the losses.

    ``a[i]`` / ``b[i]`` are views of shape ``[batch, *A_i.shape]`` / ``[batch, *B_i.shape]``."""

    flat: torch.Tensor  # [batch, D]
    layout: PairLayout
    losses: torch.Tensor  # per-sequence losses, [batch]
    _views: tuple | None = field(default=None, repr=False)

    @classmethod
    def from_pairs(cls, a, b, losses: torch.Tensor, layout: PairLayout | None = None) -> "PerSampleGrads":
        """From per-pair tensors ``[batch, *shape]`` (one copy into the matrix); pass the ``layout`` of a fixed
        model to keep its cached column index."""
        layout = layout if layout is not None else PairLayout.of(a, b, batched=True)
        flat = flatten_pairs(a, b, batched=True) if len(a) else losses.new_zeros((int(losses.shape[0]), 0))
        return cls(flat, layout, losses)

    @property
    def a(self) -> list[torch.Tensor]:
        return self._split()[0]

    @property
    def b(self) -> list[torch.Tensor]:
        return self._split()[1]

    def _split(self):
        if self._views is None:
            self._views = self.layout.split(self.flat, batched=True)
        return self._views

    @property
    def batch_size(self) -> int:
        return int(self.losses.shape[0])

    def pair_norms(self) -> torch.Tensor:
        return pair_norms(self)

    def clipped_sums(self, factors: torch.Tensor, mode: str) -> torch.Tensor:
        return clipped_sums(self, factors, mode)


def isolates_records(device: torch.device | str) -> bool:
    """Whether per-sample gradients on ``device`` are computed one record at a time: on every device but the CPU
    (ERRATA E17).

    The clipped sum's sensitivity is C only if no record changes the others' contributions. On an NVIDIA H200
    (torch 2.11, CUDA 13.0, bf16 base weights as a run loads them) a batch one record larger changed every other
    record's per-sample gradient at GPT-2 small's shape, by up to 1.3e-2 of its norm, and their clipped sum by up
    to 6.7e-2 C; with fp32 base weights by 3e-6 and 1.4e-5 C; in batches of a fixed shape a record's position
    still mattered. The matrix library chooses its kernels by shape and splits reductions by position. One record
    alone, at the run's fixed width, with deterministic kernels, changed nothing, and neither did a record kept in
    its slot of a fixed-shape pass whatever the other rows held (:class:`RecordGraph`;
    ``bench/bench_row_independence.py``; docs/privacy.md). On this project's 2-core CPU a fixed width was enough
    (no row moved at batch sizes 1 to 256); an untested device is treated as a GPU."""
    return torch.device(device).type != "cpu"


@contextlib.contextmanager
def deterministic_kernels():
    """Deterministic kernels for one isolated record's forward and backward: torch's deterministic algorithms,
    float32 reductions inside bf16/fp16 matrix products (no reduced-precision split-K), and the math attention
    kernel (plain batched matrix products); the process's settings are restored afterwards. cuBLAS reads its fixed
    workspace (``CUBLAS_WORKSPACE_CONFIG``) when it starts: :func:`raydp.model.loading.resolve_device` sets it
    before any CUDA work."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    matmul = torch.backends.cuda.matmul
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    torch.use_deterministic_algorithms(True, warn_only=True)
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        matmul.allow_bf16_reduced_precision_reduction = saved[2]
        matmul.allow_fp16_reduced_precision_reduction = saved[3]


@contextlib.contextmanager
def _without_pad_token(model: torch.nn.Module):
    """The model's configs without ``pad_token_id`` while a graph is captured: transformers reads ``input_ids`` on
    the host to warn about padding without a mask, which a capture cannot do (restored afterwards)."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None
               and getattr(c, "pad_token_id", None) is not None}
    saved = {key: config.pad_token_id for key, config in configs.items()}
    for config in configs.values():
        config.pad_token_id = None
    try:
        yield
    finally:
        for key, config in configs.items():
            config.pad_token_id = saved[key]


def attends_backwards_only(model: torch.nn.Module, width: int, device) -> bool:
    """Whether the model's outputs at a position ignore every later position (a causal decoder), checked on made-up
    tokens: the first half's logits with the second half's tokens changed must stay within 1e-3 of their scale. A
    record graph calls the model without its mask (:class:`RecordGraph`), which is exact only then: a model that
    attends both ways (an encoder loaded as a causal LM without ``is_decoder``) would see its padding."""
    if width < 4:
        return False
    generator = torch.Generator().manual_seed(0)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 100)
    ids = torch.randint(0, vocab, (2, width), generator=generator)
    ids[1, : width // 2] = ids[0, : width // 2]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids.to(device)).logits[:, : width // 2].float()
    finally:
        model.train(was_training)
    scale = float(logits[0].abs().max().clamp_min(1e-6))
    return float((logits[0] - logits[1]).abs().max()) <= 1e-3 * scale


def cuda_graph_capture(body, device: torch.device):
    """``body()`` captured in a CUDA graph after three warm-up calls on a side stream (PyTorch's whole-network
    recipe); returns (replay, the captured call's outputs, whose memory each replay rewrites)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    return graph.replay, out


#: Rows of one slotted pass on CUDA (:class:`RecordGraph` with ``rows > 1``): each record of a batch draws a slot
#: among these at random, independently of the others, and records that drew the same slot go to different passes.
#: Chosen on an NVIDIA H200 by ``bench/bench_dp_step.py --slots`` (docs/throughput.md).
RECORD_SLOTS = 8


def slot_passes(slots: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The passes of a slotted batch: pass k holds, for every slot, the k-th record (in batch order) that drew it.
    Returns (record indices, their slots) per pass; there are as many passes as the fullest slot has records."""
    slots = np.asarray(slots, dtype=np.int64)
    if slots.size == 0:
        return []
    order = np.argsort(slots, kind="stable")
    ordered = slots[order]
    rank = np.empty_like(slots)
    rank[order] = np.arange(slots.size) - np.searchsorted(ordered, ordered, side="left")  # k-th record of its slot
    return [(np.flatnonzero(rank == k), slots[rank == k]) for k in range(int(rank.max()) + 1)]


class RecordGraph:
    """A fixed-shape forward and backward of ``rows`` records at a fixed width, with deterministic kernels, captured
    once and replayed for a whole batch.

    ``rows == 1`` (records alone): each record is copied into the graph's input buffers, the graph runs, its
    per-sample gradient and loss are copied out. A replay runs the kernels chosen at capture on a [1, width] record,
    so a record's contribution is a function of that record alone, as in the eager isolated pass, without the
    host's time per kernel (on an H200 at GPT-2 small's shape, 16 records took 67 ms against 1,038 ms eagerly:
    ``bench/bench_row_independence.py``).

    ``rows > 1`` (slotted passes): each record sits in a slot of a [rows, width] pass, the slots drawn by the caller
    independently for every record (:meth:`run`); records that drew the same slot go to different passes
    (:func:`slot_passes`), and the empty slots of a pass hold an empty row (no token counted, loss 0). Every pass
    runs the same captured kernels on the same shape. On a GPU a row's result depends on its position in a pass
    (docs/privacy.md), so a record's contribution is a function of the record and its slot. It must not depend on
    what the other rows hold: the capture checks that on made-up rows (:meth:`rows_independent`) and a pass whose
    rows move each other is not used. Then adding or removing one record leaves every other record's slot
    distribution, and so its contribution given its slot, unchanged: the clipped sum of a neighbouring batch
    differs by that one record's contribution, norm <= C, for every draw of the slots (docs/privacy.md, "Slotted
    passes").

    The model is called without the attention mask (transformers' mask builder reads the mask on the host, which a
    capture cannot do). That is exact for a causal decoder's right-padded record: a real token attends only to
    earlier positions, all real, so the padding is never seen, and the loss still takes the mask. An encoder
    attends both ways and is not graphed (:func:`attends_backwards_only` checks every model first). The
    parameters are read where they live at every replay: an optimizer that updates them in place (torch's do) is
    seen by the next replay, and a parameter whose storage moved makes the graph be captured again
    (:meth:`current`). ``capture`` is :func:`cuda_graph_capture` (a test passes one that calls the body again at
    every replay)."""

    def __init__(self, computer: PerSampleGradientComputer, width: int, device: torch.device,
                 capture=cuda_graph_capture, rows: int = 1):
        self.model = computer.model
        self.pairs = computer.pairs
        self.rows = int(rows)
        self.storage = self._storage()
        self.ids = torch.zeros((self.rows, width), dtype=torch.long, device=device)
        self.mask = torch.ones((self.rows, width), dtype=torch.long, device=device)
        with deterministic_kernels(), _without_pad_token(computer.model):
            self.replay, out = capture(lambda: computer._compute(self.ids, self.mask, None, model_mask=False),
                                       device)
        self.flat, self.losses, self.layout = out.flat, out.losses, out.layout

    def _storage(self) -> tuple:
        return tuple((p.data_ptr(), p.dtype, p.device) for p in self.model.parameters())

    def current(self) -> bool:
        """Whether every parameter still lives where the graph reads it (a replay after ``model.to(dtype)`` or a
        non-in-place load would read freed memory): else the graph is captured again."""
        return self._storage() == self.storage

    def rows_independent(self, vocab: int, probes: int = 2) -> bool:
        """Whether a row's outputs (gradient and loss) stay bit for bit the same when every other row of the pass
        changes: made-up rows of random tokens and lengths, some rows kept (alternate rows, either half, one row alone)
        and the others replaced by other made-up rows or by empty rows, ``probes`` times. Every LoRA B is made nonzero
        meanwhile (a fresh adapter's B is zero, which would leave every A's gradient zero) and restored in place
        afterwards. True for a graph of one row."""
        if self.rows == 1:
            return True
        generator = torch.Generator().manual_seed(0)
        saved = [pair.b.detach().clone() for pair in self.pairs]
        try:
            with torch.no_grad():
                for pair in self.pairs:
                    pair.b.copy_(0.02 * torch.randn(tuple(pair.b.shape), generator=generator))
            return self._rows_independent(vocab, probes, generator)
        finally:
            with torch.no_grad():
                for pair, value in zip(self.pairs, saved):
                    pair.b.copy_(value)

    def _rows_independent(self, vocab: int, probes: int, generator: torch.Generator) -> bool:
        rows, width = self.ids.shape
        device = self.ids.device

        def made_up():
            ids = torch.randint(0, max(int(vocab), 2), (rows, width), generator=generator)
            lengths = torch.randint(1, width + 1, (rows, 1), generator=generator)
            return ids.to(device), (torch.arange(width)[None, :] < lengths).long().to(device)

        def outputs(ids, mask):
            self.ids.copy_(ids)
            self.mask.copy_(mask)
            self.replay()
            return self.flat.clone(), self.losses.clone()

        empty = (torch.zeros_like(self.ids), torch.zeros_like(self.mask))
        index = torch.arange(rows, device=device)
        kept_rows = (index % 2 == 0, index % 2 == 1, index < rows // 2, index >= rows // 2, index == rows // 2)
        for _ in range(probes):
            first, other = made_up(), made_up()
            base = outputs(*first)
            for kept in kept_rows:  # alternate rows, either half, one row alone
                for fill in (other, empty):
                    flat, losses = outputs(torch.where(kept[:, None], first[0], fill[0]),
                                           torch.where(kept[:, None], first[1], fill[1]))
                    if not (torch.equal(flat[kept], base[0][kept]) and torch.equal(losses[kept], base[1][kept])):
                        return False
        return True

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, slots=None) -> PerSampleGrads:
        """Per-sample gradients of the batch's records, in the batch's order. ``slots`` (``rows > 1``): each
        record's slot in ``[0, rows)``, drawn independently of the other records (the caller's secret generator);
        with one row every record is in slot 0, so each has a pass of its own."""
        n = int(input_ids.shape[0])
        slots = np.zeros(n, dtype=np.int64) if self.rows == 1 else np.asarray(slots, dtype=np.int64)  # 1: a pass each
        if slots.shape != (n,) or (n and (slots.min() < 0 or slots.max() >= self.rows)):
            raise ValueError(f"slots: one in [0, {self.rows}) per record of the batch ({n}), got {slots.shape}")
        device = self.ids.device
        flat = self.flat.new_empty((n, self.flat.shape[1]))
        losses = self.losses.new_empty((n,))
        for records, places in slot_passes(slots):
            records = torch.from_numpy(records).to(device)
            places = torch.from_numpy(places).to(device)
            self.ids.zero_()
            self.mask.zero_()  # empty rows: no token counted, loss 0
            self.ids.index_copy_(0, places, input_ids.index_select(0, records))
            self.mask.index_copy_(0, places, attention_mask.index_select(0, records))
            self.replay()
            flat.index_copy_(0, records, self.flat.index_select(0, places))
            losses.index_copy_(0, records, self.losses.index_select(0, places))
        return PerSampleGrads(flat, self.layout, losses)


def refuse_compiled(model: torch.nn.Module) -> None:
    """A model with a module compiled by ``torch.compile`` (``module.compile()``, or a ``torch.compile(module)``
    wrapper anywhere in it) is refused: dynamo may run a graph traced without the hooks a DP step relies on (measured:
    a model compiled like another one, hooks added before its first call, ran the other's graph and every per-sample
    gradient came out zero, silently; dynamo does not guard on hooks added after a compiled call), and compiling buys
    nothing on a CPU here (bench/bench_compile.py: 1.02-1.04x the eager step; docs/throughput.md). Compiled forms
    this cannot see (a compiled ``forward`` assigned to a module) are caught by the steps' own checks that their
    hooks ran (:meth:`PerSampleGradientComputer._compute`, ``ForwardLDPStep.compute``)."""
    frames = sys.modules.get("torch._dynamo.eval_frame")
    if frames is None:  # torch.compile was never called in this process (and importing dynamo takes a while)
        return
    if any(isinstance(m, frames.OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
           for m in model.modules()):
        raise ValueError("a torch.compile'd model is refused by the DP step: its compiled graph may skip the hooks "
                         "that compute per-sample gradients or add noise; pass the eager model")


class PerSampleGradientComputer:
    """Exact per-sample gradients of the LoRA matrices, by one forward hook per adapter matrix.

    LoRA's ``A`` and ``B`` are bias-free ``nn.Linear`` layers, whose per-sample gradient is
    ``grad_W[b] = sum_t g[b, t]^T x[b, t]`` (g: the gradient of the layer's output, x: its input): the rule of
    Opacus's ``GradSampleModule`` for linear layers (Yousefpour et al. 2021, Opacus; Goodfellow 2015), computed
    here as one batched matrix product per matrix from a tensor hook on the layer's output. Opacus's generic
    module and full-backward hooks cost the step about 15 ms of host time at GPT-2 small's shape (12 pairs) on an
    H200, where the whole non-private step's host time is about 40 ms: the step was bound by them. Tests
    check these gradients against Opacus's and against a per-example loop. The hooks act only inside
    :meth:`compute`; other forward passes of the model (evaluation, a public probe of another source) pass
    through untouched.

    Off the CPU no batch is computed in one pass (:func:`isolates_records`): a batched GPU pass lets one record move
    the others' gradients. On CUDA a decoder's records are replayed from a CUDA graph (:class:`RecordGraph`):
    without it, host time per kernel makes the isolated step about 20 times slower. The graph holds ``slots``
    rows, each record in a slot it draws at random (a record's contribution depends on its slot, never on the
    other records); ``slots=1`` replays one record at a time."""

    def __init__(self, model: torch.nn.Module, pairs: list[AdapterPair], loss=per_sequence_nll,
                 isolate: bool | None = None, graphs: bool = True, slots: int = RECORD_SLOTS):
        """``loss(logits, input_ids, attention_mask[, labels]) -> [batch]``: the task's per-sample loss
        (language modelling's per-sequence NLL by default; a classification task passes its own, which
        also takes the batch's labels). ``isolate``: compute each record in a pass of its own with deterministic
        kernels (None: off the CPU only, :func:`isolates_records`; True on a CPU too; False is refused off the
        CPU). ``graphs``: on CUDA, replay the records' passes from a CUDA graph (:class:`RecordGraph`) where it
        can. ``slots``: rows of the graph's pass (1: one record per pass); the slots are drawn from
        :meth:`draw_slots_from`'s generator (the DP step passes the run's secret one; else fresh OS entropy)."""
        if int(slots) < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.isolate = isolate
        self.graphs = graphs
        self.slots = int(slots)
        self._slot_rng: np.random.Generator | None = None
        self.rows_used: set[int] = set()  # rows per pass of the isolated passes computed so far (1: one record)
        self._graphs: dict[int, RecordGraph] = {}  # width -> the graph of one pass (CUDA)
        self.model = model
        self.pairs = pairs
        self.loss = loss
        self.layout = PairLayout.of([p.a for p in pairs], [p.b for p in pairs], batched=False)
        params = {id(t) for pair in pairs for t in (pair.a, pair.b)}
        modules = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m.weight) in params]
        if len(modules) != len(params):
            raise ValueError(f"found {len(modules)} linear layers for the {len(params)} LoRA matrices; per-sample "
                             "gradients are computed for LoRA adapters on linear layers only")
        for m in modules:
            if m.bias is not None and m.bias.requires_grad:
                raise ValueError("a LoRA matrix with a trainable bias (lora_bias) has no per-sample rule here")
        self._store: dict[int, torch.Tensor] | None = None  # weight id -> [batch, out, in], while computing
        self._rows = 0
        self._fired: set[int] = set()  # the LoRA layers whose forward hook ran in the current pass
        self._handles = [m.register_forward_hook(self._forward_hook) for m in modules]

    def _forward_hook(self, module: torch.nn.Linear, inputs, output: torch.Tensor) -> None:
        store, rows = self._store, self._rows
        if store is None:
            return
        self._fired.add(id(module))
        if not output.requires_grad:
            return
        x, key = inputs[0].detach(), id(module.weight)
        if x.dim() < 2 or x.shape[0] != rows:  # e.g. an adapter applied to a [1, ...] tensor shared by the batch:
            raise ValueError(f"a LoRA layer saw an input of {x.shape[0] if x.dim() else 0} rows in a batch of {rows}: "
                             "per-sample gradients need every LoRA input to carry the batch dimension")  # no broadcast

        def on_grad(g: torch.Tensor) -> None:
            grad = torch.bmm(g.reshape(rows, -1, g.shape[-1]).transpose(1, 2), x.reshape(rows, -1, x.shape[-1]))
            store[key] = grad if key not in store else store[key] + grad  # a layer called twice sums its uses

        output.register_hook(on_grad)

    def compute(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> PerSampleGrads:
        """Forward, backward of the summed per-sequence losses; returns the per-sample LoRA gradients (the
        parameters' own ``.grad`` is left empty). Isolated records: one pass per record, concatenated."""
        refuse_compiled(self.model)
        device = input_ids.device
        if self.isolate is False and isolates_records(device):
            raise ValueError(f"per-sample gradients in batches on {device.type}: one record changes the others' "
                             "there (kernels chosen by shape); a DP run computes each record alone off the CPU")
        rows = int(input_ids.shape[0])
        if not (self.isolate or isolates_records(device)) or rows == 0:
            return self._compute(input_ids, attention_mask, labels)
        graph = self._record_graph(input_ids, labels)
        self.rows_used.add(1 if graph is None else graph.rows)
        if graph is not None:
            slots = None if graph.rows == 1 else self._draw_slots(rows, graph.rows)
            return graph.run(input_ids, attention_mask, slots)
        with deterministic_kernels():
            parts = [self._compute(input_ids[i:i + 1], attention_mask[i:i + 1],
                                   None if labels is None else labels[i:i + 1]) for i in range(rows)]
        return PerSampleGrads(torch.cat([p.flat for p in parts]), self.layout, torch.cat([p.losses for p in parts]))

    def draw_slots_from(self, rng: np.random.Generator) -> None:
        """The generator of the records' slots (a DP run's secret one: :meth:`PrivateRandomness.slot_rng`)."""
        self._slot_rng = rng

    def _draw_slots(self, n: int, rows: int) -> np.ndarray:
        """A slot for each of ``n`` records, uniform on ``[0, rows)`` and independent of everything else."""
        if self._slot_rng is None:
            self._slot_rng = np.random.default_rng(secrets.randbits(128))
        return self._slot_rng.integers(0, rows, size=n)

    def _record_graph(self, input_ids: torch.Tensor, labels) -> RecordGraph | None:
        """The CUDA graph of a pass at this width (captured at its first use), or None: not on CUDA, a task with
        labels, a model that attends both ways (its records need their mask, which a graph cannot take:
        :func:`attends_backwards_only`), or a capture that failed once (then every record runs eagerly, as
        correct and slower). A slotted graph whose rows move each other (:meth:`RecordGraph.rows_independent`)
        is replaced by a graph of one record, and ``slots`` becomes 1."""
        width = int(input_ids.shape[1])
        if input_ids.device.type != "cuda" or labels is not None or not self.graphs:
            return None
        graph = self._graphs.get(width)
        if graph is not None and not graph.current():  # a parameter's storage moved: capture again
            del self._graphs[width]
        if width not in self._graphs:
            if not attends_backwards_only(self.model, width, input_ids.device):
                self.graphs = False  # a bidirectional model needs its mask: every record runs eagerly
                return None
            try:
                self._graphs[width] = self._capture(width, input_ids.device)
            except Exception as error:  # noqa: BLE001  (a capture can fail in many ways; the eager path is exact)
                warnings.warn(f"per-sample gradients: a CUDA graph of a pass could not be captured "
                              f"({type(error).__name__}: {str(error)[:200]}); each record runs eagerly (slower)")
                self.graphs = False
                return None
        return self._graphs[width]

    def _capture(self, width: int, device: torch.device, capture=cuda_graph_capture) -> RecordGraph:
        graph = RecordGraph(self, width, device, capture=capture, rows=self.slots)
        vocab = int(getattr(getattr(self.model, "config", None), "vocab_size", 0) or 2)
        if graph.rows > 1 and not graph.rows_independent(vocab):
            warnings.warn(f"per-sample gradients: in a pass of {graph.rows} rows at width {width} one row moved "
                          "another's gradient on this device; each record runs in a pass of its own (slower)")
            self.slots = 1
            del graph  # its memory goes before the graph of one record is captured
            graph = RecordGraph(self, width, device, capture=capture)
        return graph

    def _compute(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 labels: torch.Tensor | None, model_mask: bool = True) -> PerSampleGrads:
        """One pass over the rows; ``model_mask=False`` calls the model without the mask (:class:`RecordGraph`;
        the loss still takes it)."""
        store: dict[int, torch.Tensor] = {}
        self._store, self._rows = store, int(input_ids.shape[0])
        self._fired = set()
        try:
            logits = (self.model(input_ids=input_ids, attention_mask=attention_mask) if model_mask
                      else self.model(input_ids=input_ids)).logits
            if len(self._fired) != len(self._handles):  # a LoRA layer ran without its hook: its gradients would be 0
                raise ValueError(f"{len(self._handles) - len(self._fired)} of {len(self._handles)} LoRA layers ran "
                                 "without their per-sample hook (a compiled or replaced module?); pass the eager model")
            losses = (self.loss(logits, input_ids, attention_mask) if labels is None
                      else self.loss(logits, input_ids, attention_mask, labels))
            rows = int(losses.shape[0])
            losses.sum().backward()
        finally:
            self._store = None
        for pair in self.pairs:  # the batch's summed gradient is not the release
            pair.a.grad = pair.b.grad = None

        def collect(t: torch.Tensor) -> torch.Tensor:
            grad = store.get(id(t))
            return grad if grad is not None else t.detach().new_zeros((rows, *t.shape))

        return PerSampleGrads.from_pairs([collect(p.a) for p in self.pairs], [collect(p.b) for p in self.pairs],
                                         losses.detach(), self.layout)

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def zero_nonfinite(grads: PerSampleGrads) -> PerSampleGrads:
    """A sample whose loss or gradient has a non-finite entry contributes zero (loss 0, gradient 0).

    Otherwise one NaN turns the whole noisy release into NaN, which reveals that the sample was drawn:
    a release no accountant bounds. Zeroing keeps the contribution's norm (0) within every clip. Applied
    unconditionally (no device sync to ask whether anything is non-finite)."""
    finite = torch.isfinite(grads.losses) & torch.isfinite(grads.flat).all(1)
    zero = torch.zeros((), dtype=grads.flat.dtype, device=grads.flat.device)
    return PerSampleGrads(torch.where(finite.unsqueeze(1), grads.flat, zero), grads.layout,
                          torch.where(finite, grads.losses, zero.to(grads.losses.dtype)))


def combine_units(grads: PerSampleGrads, unit_index: torch.Tensor | None, n_units: int | None = None) -> PerSampleGrads:
    """One contribution per privacy unit (ERRATA E11; user-level DP-SGD, McMahan et al. 2018): the
    gradients of a unit's records are summed (then clipped as one sample), and its loss is the mean of
    its records' losses (so a loss clipped to L still has sensitivity L). ``unit_index`` maps rows to
    units 0..k-1; None means every row is its own unit. ``n_units`` (k), when the caller knows it on the
    host, saves a device sync."""
    if unit_index is None:
        return grads
    if n_units is None:
        n_units = int(unit_index.max()) + 1 if unit_index.numel() else 0
    # Off the CPU index_add_ adds with atomics, in an order the other rows can change: torch's deterministic
    # algorithm sums each unit's records in their order instead (ERRATA E17).
    context = deterministic_kernels() if isolates_records(grads.flat.device) else contextlib.nullcontext()
    with context:
        flat = grads.flat.new_zeros((n_units, grads.flat.shape[1])).index_add_(0, unit_index, grads.flat)
        losses = grads.losses.new_zeros(n_units).index_add_(0, unit_index, grads.losses)
    counts = torch.bincount(unit_index, minlength=n_units).to(grads.losses.dtype)
    return PerSampleGrads(flat, grads.layout, losses / counts.clamp_min(1))


def pair_norms(grads: PerSampleGrads) -> torch.Tensor:
    """Joint L2 norm of (g_A_i, g_B_i) per sample and pair, shape ``[batch, n_pairs]`` (Eq. 4)."""
    return grads.layout.segment_norms(grads.flat)


def group_norms(norms: torch.Tensor, mode: str) -> torch.Tensor:
    """Norms of the clip groups: the pair norms (pairwise) or the whole-gradient norm ``[batch, 1]`` (flat)."""
    if mode == "pairwise":
        return norms
    if mode == "flat":
        return norms.double().pow(2).sum(dim=1, keepdim=True).sqrt().to(norms.dtype)
    raise ValueError(f"unknown clip mode {mode!r}")


def clip_factors(norms: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
    """lambda = min(1, C / (norm + 1e-6)) per sample and group (Eq. 5)."""
    return CLIP.factors(norms, clips)


def clipped_sums(grads: PerSampleGrads, factors: torch.Tensor, mode: str) -> torch.Tensor:
    """Sum over the batch of the clipped per-sample gradients (Eq. 5, before noise), flattened ``[D]``, in float64.

    In float32 the sum's rounding depends on every unit in it, so adding one unit could move the sum by more than
    its clipped contribution (by ~4e-6 C over 4,096 units, measured in review: more than the noise margin covers;
    Casacuberta et al. 2022 on floating-point DP). In float64 that excess is ~1e-12 C."""
    if mode == "pairwise":  # one [batch, D] float64 temporary, scaled in place
        return factors.double()[:, grads.layout.pair_of_column(grads.flat.device)].mul_(grads.flat).sum(0)
    return (factors[:, :1].double() * grads.flat).sum(0)


def pair_noise_stds(group_stds, n_pairs: int, mode: str) -> list[float]:
    """Per-pair noise std: a pair's own group std (pairwise) or the single flat std for every pair."""
    return [float(s) for s in group_stds] if mode == "pairwise" else [float(group_stds[0])] * n_pairs
