"""Off the CPU a DP step computes each record alone (raydp.privacy.clipping.isolates_records).

On an NVIDIA H200 a batch one record larger changed every other record's per-sample gradient at GPT-2 small's shape
(bf16 base weights: up to 1.3e-2 of its norm, their clipped sum by up to 6.5e-2 C), and in batches of a fixed shape
a record's position mattered; one record per pass, with deterministic kernels, changed nothing
(bench/bench_row_independence.py, docs/privacy.md). These tests check on the CPU what can be checked here: the
isolated pass computes the same gradients as the batched one, the CUDA-graph replay's plumbing gives every record
its own gradient, and the batched paths are refused off the CPU. The GPU figures come from the bench on a lent GPU.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def model_and_split():
    from raydp.data import public_corpus
    from raydp.model import disable_dropout, load_model
    from raydp.model.batches import TokenizedSplit

    loaded = load_model("embedded", device="cpu", progress=False)
    disable_dropout(loaded.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for pair in loaded.pairs:
            pair.b.normal_(0.0, 0.05)  # nonzero gradients through every matrix
    split = TokenizedSplit(public_corpus(12, seed=5, progress=False), loaded.tokenizer, 64)
    return loaded, split


def test_device_rule():
    from raydp.privacy.clipping import isolates_records

    assert not isolates_records("cpu")
    assert isolates_records("cuda") and isolates_records(torch.device("cuda:1")) and isolates_records("meta")


def test_isolated_records_give_the_batched_gradients(model_and_split):
    """The isolated pass is the same function: each record's gradient and loss as in the batch, to rounding (the
    per-example loop the DP step's gradients are tested against elsewhere)."""
    from raydp.privacy.clipping import PerSampleGradientComputer

    loaded, split = model_and_split
    batch = split.collate(list(range(10)), "cpu", width=64)
    batched = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=False)
    isolated = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True)
    settings = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        g = batched.compute(batch.input_ids, batch.attention_mask)
        h = isolated.compute(batch.input_ids, batch.attention_mask)
    finally:
        batched.remove()
        isolated.remove()
    assert h.flat.shape == g.flat.shape
    assert float((h.flat - g.flat).norm(dim=1).max() / g.flat.norm(dim=1).min()) < 1e-5
    assert torch.allclose(h.losses, g.losses, rtol=1e-5, atol=0)
    assert all(p.a.grad is None and p.b.grad is None for p in loaded.pairs)  # the summed gradient is not released
    # the process's settings are restored (RLlib's seeding, run earlier in a session, may have turned them on)
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) \
        == settings


def test_an_isolated_record_is_the_same_whatever_the_batch(model_and_split):
    from raydp.privacy.clipping import PerSampleGradientComputer

    loaded, split = model_and_split
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True)
    try:
        base = computer.compute(*_ids_mask(split, [0, 1, 2, 3]))
        joined = computer.compute(*_ids_mask(split, [9, 3, 2, 1, 0]))
    finally:
        computer.remove()
    assert torch.equal(joined.flat[1:].flip(0), base.flat)
    assert torch.equal(joined.losses[1:].flip(0), base.losses)


def test_the_record_graph_replays_each_record_into_its_own_row(model_and_split):
    """RecordGraph's buffers: each record copied in, the pass run, its gradient copied out before the next
    overwrites it (here the capture is a body run again at every replay: CUDA graphs need a GPU). The model is
    called without the mask, which is exact for a right-padded record of a causal decoder."""
    from raydp.privacy.clipping import PerSampleGradientComputer, RecordGraph

    loaded, split = model_and_split

    def eager_capture(body, device):
        return body, body()

    batched = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=False)
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True)
    try:
        ids, mask = _ids_mask(split, [4, 0, 7, 2])
        assert int(mask.sum(1).min()) < 64  # right padding present: the mask-free call must not see it
        pad = loaded.model.config.pad_token_id
        graph = RecordGraph(computer, 64, torch.device("cpu"), capture=eager_capture)
        assert loaded.model.config.pad_token_id == pad  # restored after the capture

        def replay():
            out = computer._compute(graph.ids, graph.mask, None, model_mask=False)
            graph.flat.copy_(out.flat)
            graph.losses.copy_(out.losses)

        graph.replay = replay  # a CUDA replay rewrites the captured outputs in place: so does this one
        replayed = graph.run(ids, mask)
        reference = batched.compute(ids, mask)
    finally:
        batched.remove()
        computer.remove()
    assert float((replayed.flat - reference.flat).norm(dim=1).max() / reference.flat.norm(dim=1).min()) < 1e-5
    assert torch.allclose(replayed.losses, reference.losses, rtol=1e-5, atol=0)
    assert len({tuple(row[:8].tolist()) for row in replayed.flat}) == 4  # four records, four rows


def test_batched_passes_are_refused_off_the_cpu(model_and_split):
    from raydp.privacy.clipping import PerSampleGradientComputer
    from raydp.privacy.ghost import GhostClippingComputer

    loaded, split = model_and_split
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=False)
    try:
        ids = torch.zeros((2, 8), dtype=torch.long, device="meta")
        with pytest.raises(ValueError, match="one record changes the others"):
            computer.compute(ids, ids)
    finally:
        computer.remove()
    meta = torch.nn.Linear(2, 2, bias=False, device="meta")
    with pytest.raises(ValueError, match="ghost clipping computes a batch in one pass"):
        GhostClippingComputer(meta, [])


def test_per_sample_gradients_of_a_compiled_model_are_refused(model_and_split):
    """torch.compile may run a graph traced without the per-sample hooks (every gradient then zero, silently):
    per-sample and ghost gradients of a model with a compiled module in any form are refused with one line, and a
    pass in which a LoRA layer ran without its hook (a compiled forward the module check cannot see) is refused
    before its backward pass."""
    import copy

    from raydp.model import load_model
    from raydp.privacy.clipping import PerSampleGradientComputer
    from raydp.privacy.ghost import GhostClippingComputer

    _, split = model_and_split
    batch = split.collate(list(range(2)), "cpu", width=64)

    def fresh():  # a copy of its own: compiling marks the module
        loaded = load_model("embedded", device="cpu", progress=False)
        loaded.model = copy.deepcopy(loaded.model)
        from raydp.model.adapters import discover_adapter_pairs
        loaded.pairs = discover_adapter_pairs(loaded.model)
        return loaded

    def linears(model):
        return [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]

    def compile_in_place(model):
        linears(model)[0][1].compile()

    def wrap_a_submodule(model):  # a submodule replaced by torch.compile(submodule)
        name, module = linears(model)[0]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, torch.compile(module))

    for compile_ in (compile_in_place, wrap_a_submodule):
        loaded = fresh()
        computer = PerSampleGradientComputer(loaded.model, loaded.pairs)
        try:
            computer.compute(batch.input_ids, batch.attention_mask)  # eager: computed
            compile_(loaded.model)
            with pytest.raises(ValueError, match="torch.compile'd model is refused") as error:
                computer.compute(batch.input_ids, batch.attention_mask)
            assert "\n" not in str(error.value)
        finally:
            computer.remove()
    loaded = fresh()
    with pytest.raises(ValueError, match="torch.compile'd model is refused"):  # the whole model wrapped
        GhostClippingComputer(torch.compile(loaded.model), loaded.pairs).contributions(batch)

    loaded = fresh()  # a LoRA layer whose hook does not run in the pass (as a compiled forward would skip it)
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs)
    try:
        computer._handles.pop().remove()
        computer._handles.append(None)  # still counted as hooked: the pass must show it ran
        with pytest.raises(ValueError, match="1 of .* LoRA layers ran without their per-sample hook"):
            computer.compute(batch.input_ids, batch.attention_mask)
        assert all(p.a.grad is None and p.b.grad is None for p in loaded.pairs)  # no backward pass ran
    finally:
        computer._handles.pop()
        computer.remove()


def _ids_mask(split, indices):
    batch = split.collate(indices, "cpu", width=64)
    return batch.input_ids, batch.attention_mask


def test_a_transform_that_mixes_coordinates_sees_one_contribution_at_a_time():
    """GeoClip's basis is a matrix product over the per-sample gradients; computed over the whole batch, its kernels
    followed the batch's size and one unit moved the others' transformed rows (review: up to 9e-8 relative on this
    CPU at B >= 2). The DP step applies a transform row by row."""
    import numpy as np

    from raydp.privacy.engine import transform_rows
    from raydp.strategies.geoclip import SketchBasis

    rng = np.random.default_rng(0)
    d, k = 8192, 16
    basis, _ = np.linalg.qr(rng.normal(size=(d, k)))
    transform = SketchBasis(rng.normal(size=d) * 1e-3, basis, rng.uniform(0.5, 2.0, size=k))
    torch.manual_seed(0)
    rows = torch.randn(41, d) * 1e-2
    alone = [transform_rows(transform, rows[i:i + 1]) for i in range(41)]
    moved_batched = 0
    for b in (2, 3, 4, 8, 12, 17, 40):
        together = transform_rows(transform, rows[:b + 1])
        assert all(torch.equal(together[i], alone[i][0]) for i in range(b + 1))
        batched = transform.forward(rows[:b + 1])  # what the step did before
        moved_batched += sum(not torch.equal(batched[i], alone[i][0]) for i in range(b + 1))
    assert moved_batched > 0  # the batched product does move rows here: the check above can fail


def test_only_a_model_that_attends_backwards_is_graphed_without_its_mask():
    """A record graph calls the model without its mask, exact for a causal decoder only; a model that attends both
    ways would see its padding, so it is checked first."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    from raydp.privacy.clipping import attends_backwards_only

    torch.manual_seed(0)
    causal = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2))
    both_ways = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=37, max_position_embeddings=64))
    assert attends_backwards_only(causal, 32, "cpu")
    assert not attends_backwards_only(both_ways, 32, "cpu")
    assert causal.training and both_ways.training  # the check leaves the mode as it was


def test_a_record_graph_is_captured_again_when_a_parameter_moves(model_and_split):
    from raydp.privacy.clipping import PerSampleGradientComputer, RecordGraph

    loaded, _ = model_and_split
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True)
    try:
        graph = RecordGraph(computer, 16, torch.device("cpu"), capture=lambda body, device: (body, body()))
        assert graph.current()
        with torch.no_grad():
            loaded.pairs[0].a.add_(0.0)  # in place: the graph reads the new values
        assert graph.current()
        saved = loaded.pairs[0].a.data
        loaded.pairs[0].a.data = saved.clone()  # new storage: a replay would read freed memory
        assert not graph.current()
        loaded.pairs[0].a.data = saved
    finally:
        computer.remove()


def test_slot_passes_put_each_record_in_one_pass_and_each_slot_once_per_pass():
    import numpy as np

    from raydp.privacy.clipping import slot_passes

    rng = np.random.default_rng(3)
    for n, rows in ((1, 4), (16, 16), (40, 8), (7, 1)):
        slots = rng.integers(0, rows, size=n)
        passes = slot_passes(slots)
        records = np.concatenate([r for r, _ in passes])
        assert sorted(records.tolist()) == list(range(n))  # every record once
        assert len(passes) == int(np.bincount(slots).max())  # as many passes as the fullest slot's records
        for k, (r, s) in enumerate(passes):
            assert len(set(s.tolist())) == len(s) and np.array_equal(slots[r], s)  # a slot at most once per pass
            for record, slot in zip(r, s):  # the k-th record (in batch order) that drew this slot
                assert int(np.sum(slots[:record] == slot)) == k
    assert slot_passes(np.zeros(0, dtype=np.int64)) == []


def _in_place(mix: float = 0.0, position: float = 0.0):
    """A stand-in for a CUDA graph capture (CUDA graphs need a GPU): each replay runs the body again and rewrites the
    captured outputs in place, as a replay does. ``mix`` > 0 makes a pass whose rows feel each other (each row moved
    by ``mix`` times the rows' mean), as a kernel whose reduction crossed rows would. ``position`` > 0 makes a row's
    gradient depend on its position (row r scaled by 1 + position * r), as a GPU's kernels do: then a record that
    did not keep its slot comes out changed."""
    def capture(body, device):
        out = body()

        def replay():
            fresh = body()
            flat = fresh.flat
            if position:
                flat = flat * (1 + position * torch.arange(flat.shape[0], dtype=flat.dtype))[:, None]
            out.flat.copy_(flat + mix * flat.mean(0, keepdim=True) if mix else flat)
            out.losses.copy_(fresh.losses)
        return replay, out
    return capture


def test_a_slotted_pass_gives_each_record_its_own_gradient_whatever_its_neighbours(model_and_split):
    """Records in slots of one [rows, width] pass: each record's gradient and loss come back in the batch's order,
    equal to its gradient computed alone; and with its slot kept, a record's row is bit for bit the same whatever
    else the batch holds (a record inserted in front, the order reversed), as the privacy argument needs, in a pass
    whose rows depend on their position as on a GPU."""
    import numpy as np

    from raydp.privacy.clipping import PerSampleGradientComputer, RecordGraph

    loaded, split = model_and_split
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True, slots=4)
    alone = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True)
    slot_of = {0: 2, 1: 2, 2: 0, 3: 2, 4: 1, 9: 3}  # three records in slot 2: three passes
    records = [4, 0, 2, 1, 3]
    try:
        graph = RecordGraph(computer, 64, torch.device("cpu"), capture=_in_place(), rows=4)
        ids, mask = _ids_mask(split, records)
        got = graph.run(ids, mask, np.array([slot_of[r] for r in records]))
        reference = alone.compute(ids, mask)
        with pytest.raises(ValueError, match="slots"):
            graph.run(ids, mask, np.array([0, 1, 2, 3, 4]))  # slot 4 of 4 rows
        positional = RecordGraph(computer, 64, torch.device("cpu"), capture=_in_place(position=1e-3), rows=4)
        base = positional.run(ids, mask, np.array([slot_of[r] for r in records]))
        front = positional.run(*_ids_mask(split, [9] + records), np.array([slot_of[r] for r in [9] + records]))
        back = positional.run(*_ids_mask(split, records[::-1]), np.array([slot_of[r] for r in records[::-1]]))
        moved = positional.run(ids, mask, np.array([0, 1, 2, 3, 0]))  # other slots: the rows change
    finally:
        computer.remove()
        alone.remove()
    assert float((got.flat - reference.flat).norm(dim=1).max() / reference.flat.norm(dim=1).min()) < 1e-5
    assert torch.allclose(got.losses, reference.losses, rtol=1e-5, atol=0)
    assert len({tuple(row[:8].tolist()) for row in got.flat}) == 5
    assert torch.equal(front.flat[1:], base.flat) and torch.equal(front.losses[1:], base.losses)
    assert torch.equal(back.flat.flip(0), base.flat) and torch.equal(back.losses.flip(0), base.losses)
    assert not torch.equal(moved.flat, base.flat)  # the stand-in does depend on position: the checks above can fail


def test_compute_puts_each_record_in_the_slot_the_bound_generator_drew(model_and_split):
    """Through PerSampleGradientComputer.compute, as a DP step calls it: record i of the batch sits in slot
    draws[i] of the run's slot stream (recovered here from a position-dependent pass, against each record's
    gradient computed alone), and the passes used are reported."""
    from raydp.privacy.clipping import PerSampleGradientComputer
    from raydp.privacy.randomness import PrivateRandomness

    loaded, split = model_and_split
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True, slots=4)
    alone = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True)
    randomness = PrivateRandomness.unsafe_from_seed(11)
    computer.draw_slots_from(randomness.slot_rng())
    records = [5, 1, 7, 0, 3, 2, 6, 4, 8, 9, 10]
    try:
        graph = computer._capture(64, torch.device("cpu"), capture=_in_place(position=1e-3))
        computer._record_graph = lambda input_ids, labels: graph  # the CUDA graph's place (CUDA graphs need a GPU)
        ids, mask = _ids_mask(split, records)
        got = computer.compute(ids, mask)
        reference = alone.compute(ids, mask)
    finally:
        computer.remove()
        alone.remove()
    slots = randomness.slot_rng().integers(0, 4, size=len(records))  # the same stream, drawn again
    assert len(set(slots.tolist())) > 1
    expected = reference.flat * (1 + 1e-3 * torch.from_numpy(slots).to(reference.flat.dtype))[:, None]
    assert float((got.flat - expected).norm(dim=1).max() / reference.flat.norm(dim=1).min()) < 1e-5
    assert computer.rows_used == {4}


def test_a_pass_whose_rows_move_each_other_is_replaced_by_records_alone(model_and_split):
    """The capture's check (RecordGraph.rows_independent) passes a pass whose rows are independent and catches
    one where a row's gradient moves with another's; the computer then replays one record per pass."""
    from raydp.privacy.clipping import PerSampleGradientComputer

    loaded, _ = model_and_split
    vocab = loaded.model.config.vocab_size
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs, isolate=True, slots=4)

    before = [pair.b.detach().clone() for pair in loaded.pairs]
    try:
        honest = computer._capture(32, torch.device("cpu"), capture=_in_place())
        assert all(torch.equal(pair.b, b) for pair, b in zip(loaded.pairs, before))  # the check's B put back
        assert honest.rows == 4 and honest.rows_independent(vocab) and computer.slots == 4
        with pytest.warns(UserWarning, match="one row moved another"):
            graph = computer._capture(32, torch.device("cpu"), capture=_in_place(mix=1e-3))
    finally:
        computer.remove()
    assert graph.rows == 1 and computer.slots == 1


def test_slots_come_from_the_runs_secret_randomness():
    from raydp.privacy.randomness import PrivateRandomness

    fixed = PrivateRandomness.unsafe_from_seed(5)
    assert (fixed.slot_rng().integers(0, 16, 64) == fixed.slot_rng().integers(0, 16, 64)).all()  # replayable
    fresh = [PrivateRandomness.fresh().slot_rng().integers(0, 2**62, 4).tolist() for _ in range(2)]
    assert fresh[0] != fresh[1]
    assert not (fixed.slot_rng().standard_normal(8) == fixed.noise("cpu").randn((8,), torch.float64).numpy()).all()
