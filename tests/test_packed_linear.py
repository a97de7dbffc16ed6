"""Multi-token steps on oneDNN-packed weights (``core/packed_linear.py``): the packed layer computes
the linear layer, only inside specdec's multi-token steps, the model is unchanged outside them, and
decoding stays exact."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationMixin

from specdec import ConfigError, SpeculativeDecoder
from specdec.config import SpecdecConfig
from specdec.core import packed_linear
from specdec.drafters import HiddenStateDrafter, ModelDrafter, NGramDrafter, SharedEncoderDrafter
from specdec.errors import PackingWarning, RereadWarning
from specdec.policies import ConstantLookahead

from .architectures import tiny_family_model
from .conftest import (REAL_RECORD, REAL_RECORDED, REAL_TIME_SHAPE, REAL_TIME_SHAPE_BFLOAT16, REAL_TIME_SHAPE_COPY_FREE,
                       greedy_reference, left_padded_prompts, pin_packing, tiny_model)
from .test_pair import PAIR, needs_pair
from .tiny_whisper import NO_TIMESTAMPS, SOT, TRANSCRIBE, decoder_of, features, tiny_whisper

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch has no oneDNN")
needs_bfloat16 = pytest.mark.skipif(not packed_linear.bfloat16_available(), reason="no oneDNN bfloat16 matmul here")
needs_int8 = pytest.mark.skipif(not packed_linear.int8_available(), reason="no fbgemm int8 linear here")


def linear(out_features=2048, in_features=512, bias=True, dtype=torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype).eval()


class PackCounter:
    """Records the weight and rows of every linear call that ran on a packed weight, by identity."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = packed_linear._packed_forward

        def counting(module, packed_at, widths, x):
            if packed_linear.trial_width(x.numel() // x.shape[-1]) in packed_at:
                self.calls.append((module.weight, x.numel() // x.shape[-1]))
            return original(module, packed_at, widths, x)

        monkeypatch.setattr(packed_linear, "_packed_forward", counting)

    def packed(self, weight, rows: int | None = None) -> int:
        return sum(w is weight and rows in (None, n) for w, n in self.calls)


@torch.no_grad()
def test_packed_layer_computes_the_linear_layer_and_is_removed_after(monkeypatch):
    counter = PackCounter(monkeypatch)
    layer = linear()
    x = torch.randn(2, 3, 512)  # 6 rows
    with packed_linear.packed_steps(layer, rows=6):
        assert "forward" in layer.__dict__
        packed = layer(x)
    assert counter.packed(layer.weight) == 1
    torch.testing.assert_close(packed, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert "forward" not in layer.__dict__  # the layer is nn.Linear's own again
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@torch.no_grad()
def test_what_stays_on_torchs_path(monkeypatch):
    counter = PackCounter(monkeypatch)
    layer, small = linear(), linear(256, 512)
    model = torch.nn.Sequential(layer, torch.nn.ReLU(), linear(512, 2048), small)
    few = torch.randn(3, 512)
    with packed_linear.packed_steps(model, rows=3):  # fewer rows than measured faster: nothing switched
        assert "forward" not in layer.__dict__
        assert torch.equal(model(few), model[3](model[2](model[1](F.linear(few, layer.weight, layer.bias)))))
    with packed_linear.packed_steps(model, rows=4):
        model(torch.randn(4, 512))
        assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))  # a 3-row call inside
    assert counter.packed(layer.weight) == 1 and counter.packed(small.weight) == 0  # 256 x 512: never faster
    assert not packed_linear.applies_to(linear(dtype=torch.float64))
    assert packed_linear.applies_to(layer)


def test_packing_is_chosen_per_width_where_it_wins():
    def table(*pairs):  # (torch's ms, packed ms) at each trial width
        return dict(zip(packed_linear.TRIAL_ROWS[1:], pairs))

    def widths(*rows):
        return frozenset(rows)

    assert packed_linear.TRIAL_ROWS == (1, 2, 3, 4, 8, 12, 16)
    epyc_head = table((24.2, 9.7), (37.0, 7.2), (19.6, 6.2), (20.8, 8.6), (25.0, 10.0), (27.3, 11.3))
    xeon_head = table((7.0, 7.6), (8.9, 8.6), (13.9, 8.0), (22.9, 9.7), (20.0, 11.0), (17.2, 12.2))
    assert packed_linear.widths_faster(epyc_head) == widths(2, 3, 4, 8, 12, 16)
    assert packed_linear.widths_faster(xeon_head) == widths(4, 8, 12, 16)
    # SmolLM2's 1536 x 576 MLP weight on the Xeon (stop 26): sgemm's 16-row kernel beats oneDNN's,
    # its 4- to 12-row ones do not. A rule that wanted a win at every wider width never packed it.
    xeon_mlp = table((0.27, 0.26), (0.27, 0.26), (0.34, 0.25), (0.40, 0.29), (0.38, 0.30), (0.35, 0.38))
    assert packed_linear.widths_faster(xeon_mlp) == widths(4, 8, 12)
    assert packed_linear.widths_faster(table((1.0, 0.5), (1.0, 0.95), (1.5, 0.9), (2.0, 1.2), (2.5, 1.5), (3.0, 2.0))) \
        == widths(2, 4, 8, 12, 16)  # a loss at 3 alone
    assert packed_linear.widths_faster(table(*[(1.0, 0.91)] + [(1.0, 0.9)] * 5)) == widths(3, 4, 8, 12, 16)  # MARGIN
    assert packed_linear.widths_faster(table((1.3, 1.7), (1.7, 2.4), (2.5, 3.5), (4.4, 5.6), (7.0, 7.2), (9.3, 7.5))) \
        == widths(16)  # Xeon 576 x 576, an earlier session
    # A 2-row call that loses packed but wins padded to 4 rows is packed, padded.
    assert packed_linear.widths_faster(table((1.0, 1.0), (1.2, 1.1), (1.5, 0.5), (2.0, 0.9), (2.5, 1.2), (3.0, 1.5))) \
        == widths(2, 3, 4, 8, 12, 16)
    # A call goes the way of the widest trial width at or below its rows.
    assert [packed_linear.trial_width(rows) for rows in (1, 2, 3, 4, 5, 7, 8, 11, 12, 15, 16, 1500)] == \
        [1, 2, 3, 4, 4, 4, 8, 8, 12, 12, 16, 16]


@torch.no_grad()
def test_a_layer_packs_at_the_widths_it_wins_and_not_between(monkeypatch):
    monkeypatch.setattr(packed_linear, "time_shape", lambda weight: {  # packed wins at 4 and 8 rows only
        rows: (1.0, 0.5) if rows in (4, 8) else (0.5, 1.0) for rows in packed_linear.TRIAL_ROWS})
    counter = PackCounter(monkeypatch)
    layer = linear()
    assert packed_linear.faster_at(layer.weight) == frozenset({4, 8})
    assert [packed_linear.packs_at(layer, rows) for rows in (2, 3, 4, 11, 12, 16, 40)] == [False, False, True, True,
                                                                                            False, False, False]
    for rows in (3, 4, 7, 9, 12, 16):
        x = torch.randn(rows, 512)
        with packed_linear.packed_steps(layer, rows=rows):
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert [rows for _, rows in counter.calls] == [4, 7, 9]
    with packed_linear.packed_everywhere(layer):  # generate on the packed weights: each call by its own rows
        for rows in (1, 5, 13, 8):
            layer(torch.randn(rows, 512))
    assert [rows for _, rows in counter.calls] == [4, 7, 9, 5, 8]


def test_a_packed_call_is_padded_to_a_wider_width_that_is_measured_faster(monkeypatch):
    def table(*packed):  # torch's path slower than any packed width
        return {rows: (20.0, ms) for rows, ms in zip(packed_linear.TRIAL_ROWS[1:], packed)}

    # SmolLM2's head on the EPYC, cold (ms packed): oneDNN's 2-row kernel is its slowest.
    assert packed_linear.pad_widths(table(8.98, 6.28, 5.82, 7.80, 9.5, 11.0)) == {2: 4}  # 3 -> 4 saves 7%: not MARGIN
    assert packed_linear.pad_widths(table(9.0, 6.0, 4.0, 4.5, 3.5, 3.0)) == {2: 16, 3: 16, 4: 16, 8: 16, 12: 16}  # the fastest
    assert packed_linear.pad_widths(table(1.0, 1.0, 1.1, 2.0, 3.0, 4.0)) == {}  # each width costs what it holds
    # Never to a width where torch's path is as fast as packed: the Xeon's 576 x 576 weight, cold, where
    # both kernels ran 2 rows slower than 4, and packed and padded 2-token forwards ran slower.
    xeon_576 = {1: (0.091, 0.111), 2: (0.101, 0.102), 3: (0.085, 0.097), 4: (0.079, 0.081), 8: (0.100, 0.099),
                12: (0.110, 0.111), 16: (0.118, 0.126)}
    assert packed_linear.pad_widths(xeon_576) == {} and packed_linear.widths_faster(xeon_576) == frozenset()
    # sgemm's 16-row kernel beats oneDNN's, so 12 rows are packed as they are, not padded to 16.
    xeon_mlp = {1: (0.199, 0.274), 2: (0.215, 0.276), 3: (0.215, 0.260), 4: (0.310, 0.239), 8: (0.370, 0.276),
                12: (0.482, 0.407), 16: (0.314, 0.355)}
    assert packed_linear.pad_widths(xeon_mlp) == {1: 4, 2: 4} and packed_linear.widths_faster(xeon_mlp) == {4, 8, 12}

    seen = []
    kernel = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *rest: seen.append(x.shape[0]) or kernel(x, *rest))
    monkeypatch.setattr(packed_linear, "time_shape", lambda weight: {
        rows: (2.0, ms) for rows, ms in zip(packed_linear.TRIAL_ROWS, (2.5, 1.5, 0.6, 0.5, 0.9, 1.2, 1.6))})
    layer = linear()
    assert packed_linear.faster_at(layer.weight) == frozenset({2, 3, 4, 8, 12, 16})
    assert packed_linear.padded_widths(layer.weight) == {1: 4, 2: 4, 3: 4}
    with torch.no_grad():
        for shape in ((1, 2, 512), (2, 1, 512), (3, 512), (5, 512), (1, 1, 512)):
            x = torch.randn(shape)
            with packed_linear.packed_steps(layer, rows=x.numel() // 512):
                out = layer(x)
            assert out.shape == (*shape[:-1], 2048)  # the padding's rows dropped
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert seen == [4, 4, 4, 5]  # 2 and 3 rows padded to 4; 5 rows (not a trial width) as they are; 1 row never packed
    x = torch.randn(1, 1, 512)
    with torch.no_grad(), packed_linear.packed_steps(layer, rows=1, one_row=True):  # a drafter's step
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert seen[4:] == [4]  # padded too: 2.5 ms packed at one row, 0.5 at four


@torch.no_grad()
def test_the_measurement_times_each_shape_once_on_this_machine(monkeypatch):
    calls = []

    def timed(weight):
        calls.append(tuple(weight.shape))
        return REAL_TIME_SHAPE(weight)

    monkeypatch.setattr(packed_linear, "time_shape", timed)
    model = torch.nn.Sequential(linear(), linear(512, 2048), linear())  # two of one shape
    layers = packed_linear.packed_layers(model)
    assert sorted(calls) == [(512, 2048), (2048, 512)]
    times = REAL_TIME_SHAPE(model[0].weight)
    assert sorted(times) == list(packed_linear.TRIAL_ROWS) and all(a > 0 and b > 0 for a, b in times.values())
    widths = {tuple(module.weight.shape): at for module, at in layers}
    assert all(at and at <= set(packed_linear.TRIAL_ROWS[1:]) for at in widths.values())
    assert set(widths) <= {(2048, 512), (512, 2048)}
    assert packed_linear.packs_at(model, 8) == any(8 in at for at in widths.values())
    packed_linear.packed_layers(torch.nn.Sequential(linear()))  # another model, a shape already timed
    assert len(calls) == 2


def measurements_in(monkeypatch, tmp_path) -> None:
    """Read and write ``packing.json`` for real (the suite pins the timings and keeps the file out),
    in a cache of the test's own."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packed_linear, "_recorded", REAL_RECORDED)
    monkeypatch.setattr(packed_linear, "_record", REAL_RECORD)


@torch.no_grad()
def test_a_measurement_is_kept_for_the_next_process_on_this_machine(monkeypatch, tmp_path):
    measurements_in(monkeypatch, tmp_path)
    timed = []
    times = {1: (0.5, 0.6), 2: (1.0, 1.0), 3: (1.0, 0.5), 4: (1.2, 0.4), 8: (1.5, 0.6), 12: (1.8, 0.8), 16: (2.0, 1.0)}
    everywhere = frozenset({2, 3, 4, 8, 12, 16})
    monkeypatch.setattr(packed_linear, "time_shape", lambda weight: timed.append(tuple(weight.shape)) or times)
    weight = linear().weight
    assert packed_linear.faster_at(weight) == everywhere and timed == [(2048, 512)]  # 2 rows: packed when padded to 4
    assert packed_linear.padded_widths(weight) == {1: 4, 2: 4, 3: 4}
    record = json.loads(packed_linear.measurements_file().read_text())
    assert packed_linear.measurements_file() == tmp_path / "cache" / "packing.json"
    assert list(record.values()) == [{str(rows): list(pair) for rows, pair in times.items()}]  # the times, not a rule
    assert list(record)[0].endswith(f"|{torch.get_num_threads()} threads|2048x512|{packed_linear.TIMING_ROUNDS} rounds")
    monkeypatch.setattr(packed_linear, "_MEASURED", {})  # a new process
    assert packed_linear.faster_at(weight) == everywhere and len(timed) == 1  # read, not timed again
    assert packed_linear.padded_widths(weight) == {1: 4, 2: 4, 3: 4} and len(timed) == 1
    monkeypatch.setattr(packed_linear, "_MEASURED", {})
    packed_linear.measurements_file().write_text("not json")  # a damaged file: measured again, rewritten
    assert packed_linear.faster_at(weight) == everywhere and len(timed) == 2
    assert len(json.loads(packed_linear.measurements_file().read_text())) == 1
    key = list(json.loads(packed_linear.measurements_file().read_text()))[0]
    for damaged in ("3", 3, {"2": [1.0, 1.0]}, {**record[key], "16": [1.0, -1.0]}, {**record[key], "16": "fast"}):
        # a rule from before times were kept, a width missing, a time that is not one: timed again
        monkeypatch.setattr(packed_linear, "_MEASURED", {})
        packed_linear.measurements_file().write_text(json.dumps({key: damaged}))
        before = len(timed)
        assert packed_linear.faster_at(weight) == everywhere and len(timed) == before + 1
    monkeypatch.setattr(packed_linear, "_MEASURED", {})
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("SPECDEC_CACHE", str(blocked))  # a cache that cannot be written: kept in the process
    assert packed_linear.faster_at(weight) == everywhere and len(timed) == 8


def test_a_shape_timed_in_a_single_round_is_timed_again(monkeypatch, tmp_path):
    """Stops 20-34 timed a shape in one round and keyed it without a count of rounds: such an entry
    is not read, the shape is timed again and recorded beside it."""
    measurements_in(monkeypatch, tmp_path)
    timed = []
    times = {rows: (1.0, 0.5) for rows in packed_linear.TRIAL_ROWS}
    monkeypatch.setattr(packed_linear, "time_shape", lambda weight: timed.append(tuple(weight.shape)) or times)
    weight = linear().weight
    key = packed_linear._machine_key(tuple(weight.shape))
    one_round = key.rsplit("|", 1)[0]
    assert key.endswith(f"|{packed_linear.TIMING_ROUNDS} rounds") and one_round.endswith("|2048x512")
    packed_linear.measurements_file().parent.mkdir(parents=True)
    packed_linear.measurements_file().write_text(json.dumps({one_round: {rows: [1.0, 2.0] for rows in times}}))
    assert packed_linear.faster_at(weight) == frozenset({2, 3, 4, 8, 12, 16}) and len(timed) == 1  # timed, not read
    assert sorted(json.loads(packed_linear.measurements_file().read_text())) == sorted([one_round, key])


def test_a_burst_in_one_round_of_timing_does_not_decide_a_shape(monkeypatch):
    """Each path and width is timed in every round, the paths in turn, and keeps its fastest round:
    a neighbour's burst while one path is timed (here packed at 3 rows, the first round) is outvoted."""
    calls = []

    def fastest(call):
        path = "packed" if len(calls) % 2 else "torch"
        rows = packed_linear.TRIAL_ROWS[len(calls) // 2 % len(packed_linear.TRIAL_ROWS)]
        calls.append((path, rows))
        burst = path == "packed" and rows == 3 and len(calls) <= 2 * len(packed_linear.TRIAL_ROWS)
        return (0.9 if burst else 0.3) if path == "packed" else 0.5

    monkeypatch.setattr(packed_linear, "_fastest", fastest)
    monkeypatch.setattr(packed_linear, "COLD_BYTES", 1)  # one copy of the weight
    times = REAL_TIME_SHAPE(torch.zeros(64, 64))
    assert len(calls) == 2 * len(packed_linear.TRIAL_ROWS) * packed_linear.TIMING_ROUNDS
    assert calls[:4] == [("torch", 1), ("packed", 1), ("torch", 2), ("packed", 2)]  # in turn, width by width
    assert times[3] == (0.5, 0.3)
    monkeypatch.setattr(packed_linear, "TIMING_ROUNDS", 1)  # one round: the burst decides
    calls.clear()
    assert REAL_TIME_SHAPE(torch.zeros(64, 64))[3] == (0.5, 0.9)


def test_two_generations_of_cpu_with_one_generic_name_are_kept_apart():
    """A virtual machine may call a Zen 3 and a Zen 4 both "AMD EPYC": the family and model numbers
    go into the name that keys the measurements (and labels benchmark tables)."""
    def cpuinfo(model):
        block = f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\n"
        return block.format(0) + "\n" + block.format(1).replace("AMD EPYC", "ignored: the first block names it")

    assert packed_linear._cpu_name(cpuinfo(1)) == "AMD EPYC (family 25, model 1)"
    assert packed_linear._cpu_name(cpuinfo(17)) == "AMD EPYC (family 25, model 17)"
    assert packed_linear._cpu_name("model name\t: Some CPU\n") == "Some CPU"  # no numbers: the name alone
    assert packed_linear.cpu_name() in packed_linear._machine_key((4, 4))


@torch.no_grad()
def test_a_machine_where_packing_wins_from_two_rows_packs_two_row_blocks_never_one_row(monkeypatch):
    pin_packing(monkeypatch, start=2)
    counter = PackCounter(monkeypatch)
    layer = linear()
    assert packed_linear.packs_at(layer, 2) and not packed_linear.packs_at(layer, 1)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 512)
        with packed_linear.packed_steps(layer, rows=rows):
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert counter.packed(layer.weight) == 2  # the 2- and 3-row calls
    with packed_linear.packed_everywhere(layer):
        layer(torch.randn(1, 512))
    assert counter.packed(layer.weight) == 2
    pin_packing(monkeypatch, start=None)
    assert packed_linear.packed_layers(linear()) == [] and not packed_linear.packs_at(linear(), 16)


@torch.no_grad()
def test_a_weight_changed_in_place_is_packed_again():
    layer = linear()
    x = torch.randn(5, 512)
    with packed_linear.packed_steps(layer, rows=5):
        layer(x)
        layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@torch.no_grad()
@torch.no_grad()
def test_a_model_too_big_for_the_memory_left_is_not_packed_and_goes_copy_free(monkeypatch):
    pin_packing(monkeypatch, smallest=0, copy_free="transposed")
    counter = PackCounter(monkeypatch)
    layer = linear()  # 4 MiB of weight
    monkeypatch.setattr(packed_linear, "free_memory", lambda: 3 * 2**20)
    x = torch.randn(8, 512)
    with pytest.warns(PackingWarning, match=r"Linear's multi-token steps read its weights as loaded \(the copy-free "
                                            r"routes of packed_weights = false\): its packed weights \(0.00 GiB\) "
                                            r"would take more than half of the 0.00 GiB"):
        packed_linear.pack(layer)  # as a request begins
    assert packed_linear.too_big_to_pack(layer) and not packed_linear.has_packed_copy(layer.weight)
    with packed_linear.packed_steps(layer, rows=8):
        assert packed_linear.is_copy_free(layer.__dict__["forward"])
        out = layer(x)
    assert counter.packed(layer.weight) == 0 and not packed_linear.has_packed_copy(layer.weight)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_weights_are_packed_as_a_request_begins_not_in_a_timed_step(monkeypatch):
    """Packing SmolLM2 takes most of a second: it happens before the loop, so no policy times it as
    a step. With plain steps only (and the 6-token prefill on torch's path, as generate reads it) no
    call runs packed, yet the weights are packed all the same (and without packed weights, the
    copy-free routes chosen); a float64 model never is, nor a model specdec re-reads whole (its
    forwards are generate's own)."""
    from .conftest import tiny_llama

    pin_packing(monkeypatch, smallest=0)
    counter = PackCounter(monkeypatch)
    target = tiny_llama(seed=0, vocab=16)
    prompt = torch.tensor([[3, 5, 7, 9, 11, 4]])  # 6 rows: the prefill would be packed if it were a step
    out = SpeculativeDecoder(target=target, drafter=NGramDrafter(), policy=ConstantLookahead(k=0)).generate(
        prompt, max_new_tokens=5)
    assert torch.equal(out.sequences, target.generate(prompt, max_new_tokens=5, do_sample=False))
    assert target.lm_head.weight in packed_linear._PACKED and not counter.calls
    # Without packed weights the copy-free routes are chosen (timed, on a new machine) as it begins too.
    out = SpeculativeDecoder(target=target, drafter=NGramDrafter(), policy=ConstantLookahead(k=0),
                             packed_weights=False).generate(prompt, max_new_tokens=5)
    assert target in packed_linear._COPY_FREE_PLANS and out.stats.new_tokens == 5
    wide = tiny_llama(seed=0, vocab=16, dtype=torch.float64)
    SpeculativeDecoder(target=wide, drafter=NGramDrafter(), policy=ConstantLookahead(k=0)).generate(prompt, max_new_tokens=2)
    assert wide.lm_head.weight not in packed_linear._PACKED
    reread = copy.deepcopy(tiny_family_model("local")).float()  # GPT-Neo: a RereadingRunner
    with pytest.warns(RereadWarning):
        decoder = SpeculativeDecoder(target=reread, drafter=NGramDrafter(), policy=ConstantLookahead(k=3))
    decoder.generate(prompt, max_new_tokens=4)
    assert not any(parameter in packed_linear._PACKED for parameter in reread.parameters())
    assert not counter.calls


def float32_pair_and_prompts():
    """The bundled pair's target in float32 (its LM head is large enough to pack) and four
    left-padded prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR, local_files_only=True, padding_side="left")
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32, local_files_only=True).eval()
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef main(", "class Stack:\n    def push(self, item):\n",
               "    for i in range(10):\n"]
    return target, tokenizer(prompts, return_tensors="pt", padding=True)


def equals_generate_at_1_and_4(decoder, target, batch) -> None:
    for rows in (slice(0, 1), slice(0, 4)):
        inputs = {name: value[rows] for name, value in batch.items()}
        expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
        out = decoder.generate(**inputs, max_new_tokens=24)
        assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]])


@needs_pair
def test_the_bundled_pair_verifies_on_packed_weights_and_equals_generate(monkeypatch):
    """The bundled pair in float32 (its LM head's weight is large enough to pack): verify
    blocks run on packed weights, the output is generate's at batch 1 and 4, and the target's own
    generate is bit for bit what it was."""
    target, batch = float32_pair_and_prompts()
    reference = target.generate(**batch, max_new_tokens=24, do_sample=False, output_scores=True,
                                return_dict_in_generate=True)
    config = SpecdecConfig.from_toml(REPO_TOML)
    for packed in (False, True):
        counter = PackCounter(monkeypatch)
        decoder = SpeculativeDecoder.from_config(config, target=target)
        decoder.packed_weights = packed
        equals_generate_at_1_and_4(decoder, target, batch)
        assert (counter.packed(target.lm_head.weight) > 0) is packed
        assert (target.lm_head.weight in packed_linear._PACKED) is packed  # packed as the request began
    again = target.generate(**batch, max_new_tokens=24, do_sample=False, output_scores=True,
                            return_dict_in_generate=True)
    assert torch.equal(again.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(again.scores, reference.scores))


REPO_TOML = PAIR.parent.parent / "plugins.toml"


@needs_pair
@torch.no_grad()
def test_a_drafters_one_row_steps_run_packed_where_faster_the_targets_never(monkeypatch):
    """On a CPU where a one-row call is faster packed (a Zen 4's), the draft model's one-token steps
    run packed; the target's plain steps stay on torch's path, as generate's; the output is generate's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pin_packing(monkeypatch, start=4, smallest=1 << 20, one_row=True)  # both LM heads, no other weight
    counter = PackCounter(monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(PAIR, local_files_only=True, padding_side="left")
    target, draft = (AutoModelForCausalLM.from_pretrained(PAIR / name, dtype=torch.float32, local_files_only=True).eval()
                     for name in ("target", "draft"))
    batch = tokenizer(["def fibonacci(n):\n", "import os\n\n\ndef main("], return_tensors="pt", padding=True)
    for policy in (ConstantLookahead(k=3), ConstantLookahead(k=0)):
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=policy)
        out = decoder.generate(**batch, max_new_tokens=24)
        expected = target.generate(**batch, max_new_tokens=24, do_sample=False)
        assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]])
    assert counter.packed(target.lm_head.weight, rows=8) > 0  # a verify: 2 rows x 4 tokens
    assert counter.packed(draft.lm_head.weight, rows=2) == 0  # a draft step of 2 rows: torch's, as measured
    assert counter.packed(target.lm_head.weight, rows=2) == 0  # the plain steps of k = 0: never packed
    single = tokenizer(["def fibonacci(n):\n"], return_tensors="pt")
    SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=3)).generate(
        **single, max_new_tokens=8)
    assert counter.packed(draft.lm_head.weight, rows=1) > 0 and counter.packed(target.lm_head.weight, rows=1) == 0


@needs_pair
def test_the_benchs_draft_cost_is_timed_as_a_drafter_step_runs(monkeypatch):
    """``specdec bench``'s ceiling divides by the draft's step cost: timed packed, its one-row call
    runs on packed weights where that is faster, as a drafter's step does in the loop."""
    from transformers import AutoModelForCausalLM

    from specdec.bench import forward_cost

    pin_packing(monkeypatch, start=4, smallest=1 << 20, one_row=True)
    counter = PackCounter(monkeypatch)
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft", dtype=torch.float32, local_files_only=True).eval()
    assert forward_cost(draft, 1, context=16, repeats=2) > 0
    assert counter.packed(draft.lm_head.weight) == 0  # unpacked unless asked
    assert forward_cost(draft, 1, context=16, repeats=2, packed=True) > 0
    assert counter.packed(draft.lm_head.weight, rows=1) == 2


@torch.no_grad()
def test_whisper_decoder_steps_pack_and_stay_exact(monkeypatch):
    """An encoder-decoder target in float32 with every weight packed (each timed faster packed from
    4 rows, whatever its size): the decoder's multi-token steps and the shared-encoder draft's
    batched steps use packed weights, the encoder never does, and the transcript is generate's."""
    pin_packing(monkeypatch, smallest=0)
    counter = PackCounter(monkeypatch)
    target = tiny_whisper(seed=0).float()
    drafter = SharedEncoderDrafter(model=decoder_of(target))
    x = features(4, seed=11).float()
    prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 4)
    reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=16)
    decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3))
    out = decoder.generate(prompt, input_features=x, max_new_tokens=16)
    assert torch.equal(out.sequences, reference)
    assert counter.packed(target.proj_out.weight) > 0
    # The target's first read (4 prompt tokens and 3 drafts a row) verifies drafts: packed as its steps.
    assert counter.packed(target.model.decoder.layers[0].fc1.weight, rows=4 * (4 + 3)) == 1
    encoder_weights = {id(p) for p in target.get_encoder().parameters()}
    assert not any(id(w) in encoder_weights for w, _ in counter.calls)
    assert not any(p in packed_linear._PACKED for p in target.get_encoder().parameters())  # not even copied
    # Nor the cross-attention's keys and values, which a step reads from the cache; its queries are.
    cross = target.model.decoder.layers[0].encoder_attn
    assert cross.q_proj.weight in packed_linear._PACKED
    assert cross.k_proj.weight not in packed_linear._PACKED and cross.v_proj.weight not in packed_linear._PACKED
    # Without a draft to share them, the target computes the cross-attention keys itself, once, in its
    # first decoder read: on torch's path, as generate's; its later steps are packed.
    counter.calls.clear()
    out = SpeculativeDecoder(target=target, drafter=NGramDrafter(), policy=ConstantLookahead(k=3)).generate(
        prompt, input_features=x, max_new_tokens=16)
    assert torch.equal(out.sequences, reference)
    assert counter.packed(target.proj_out.weight) > 0
    assert counter.packed(target.model.decoder.layers[0].encoder_attn.k_proj.weight) == 0
    # A first read that scores one position (no drafts: a plain first step, 4 prompt tokens a row)
    # stays generate's own; the batch's plain steps after it (4 rows of one token) are packed.
    counter.calls.clear()
    out = SpeculativeDecoder(target=target, drafter=NGramDrafter(), policy=ConstantLookahead(k=0)).generate(
        prompt, input_features=x, max_new_tokens=4)
    assert torch.equal(out.sequences, reference[:, :prompt.shape[1] + 4])
    assert {rows for _, rows in counter.calls} == {4}


@torch.no_grad()
@pytest.mark.parametrize("precision, copies", [pytest.param("medium", "_PACKED_BF16", marks=needs_bfloat16),
                                               pytest.param("int8", "_PACKED_INT8", marks=needs_int8)])
def test_a_whisper_draft_on_bfloat16_or_int8_weights_stays_exact(monkeypatch, precision, copies):
    """The shared-encoder draft of a float32 Whisper with every layer reading bfloat16 weights
    ("medium") or int8 ones: the transcript is generate's, the draft drafted and was accepted, its
    decoder layers were copied to that precision, and none of the target's weights were."""
    pin_packing(monkeypatch, smallest=0, one_row=True)
    monkeypatch.setattr(packed_linear, copies, packed_linear.WeakIdKeyDictionary())
    target = tiny_whisper(seed=0).float()
    draft = decoder_of(target)
    x = features(4, seed=11).float()
    prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 4)
    reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=16)
    decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft, matmul_precision=precision),
                                 policy=ConstantLookahead(k=3))
    out = decoder.generate(prompt, input_features=x, max_new_tokens=16)
    assert torch.equal(out.sequences, reference)
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    copied = getattr(packed_linear, copies)
    assert draft.model.decoder.layers[0].fc1.weight in copied
    assert not any(parameter in copied for parameter in target.parameters())


@pytest.mark.parametrize("attention, projections", [
    ("encoder_attn", ("q_proj", "k_proj", "v_proj", "out_proj")),  # Whisper, BART, Marian, M2M100
    ("EncDecAttention", ("q", "k", "v", "o")),  # T5
    ("crossattention", ("query", "key", "value", "dense")),  # BERT-style decoders
    ("cross_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),  # T5Gemma, Mllama
    ("cross_attention", ("q_proj", "k_proj", "v_proj", "out_proj")),  # SeamlessM4T, NLLB-MoE, Dia
    ("encoder_decoder_attention", ("query", "key", "value", "output")),  # Pix2Struct
])
def test_only_cross_attention_keys_and_values_are_left_out_of_packing(attention, projections):
    """The projections that read the encoder's output are never packed or copied, under each name
    transformers gives a cross-attention; its query and output and every self-attention are."""
    def block():
        return torch.nn.ModuleDict({name: torch.nn.Linear(256, 256) for name in projections})

    layer = torch.nn.ModuleDict({"self_attn": block(), attention: block()})
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layer])})
    packable = {id(module) for module in packed_linear._candidates(model)}
    q, k, v, o = projections
    assert id(layer[attention][k]) not in packable and id(layer[attention][v]) not in packable
    assert id(layer[attention][q]) in packable and id(layer[attention][o]) in packable
    assert all(id(module) in packable for module in layer["self_attn"].values())


@torch.no_grad()
@pytest.mark.parametrize("precision", [pytest.param("medium", marks=needs_bfloat16), pytest.param("int8", marks=needs_int8)])
def test_the_cross_attention_keys_a_draft_lends_the_target_are_generates_own(monkeypatch, precision):
    """A shared-encoder draft on bfloat16 or int8 weights reads its short prompt on them too, but the
    cross-attention keys and values it computes there, which the target then reads instead of its
    own, come from torch's float32 path: bit for bit those of the target's layers over the encoder
    output. (On a tiny model keys rounded to int8 can leave the transcript unchanged, so the keys
    themselves are compared.)"""
    pin_packing(monkeypatch, smallest=0, one_row=True)
    target = tiny_whisper(seed=0).float()
    draft = decoder_of(target)
    x = features(2, seed=11).float()
    prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 2)
    computed, prompt_reads = [], []
    for layer in draft.model.decoder.layers:
        for projection in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj):
            projection.register_forward_hook(lambda module, args, out: computed.append((module, args[0], out)))
    fc1 = draft.model.decoder.layers[0].fc1
    fc1.register_forward_hook(lambda module, args, out: prompt_reads.append("forward" in module.__dict__))
    decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft, matmul_precision=precision),
                                 policy=ConstantLookahead(k=3))
    out = decoder.generate(prompt, input_features=x, max_new_tokens=8)
    assert out.stats.drafted > 0
    assert prompt_reads[0]  # the draft's first read (the prompt) ran on its bfloat16 or int8 weights
    encoded = target.get_encoder()(x).last_hidden_state
    assert len(computed) == 2 * len(draft.model.decoder.layers)  # once a request, in the first read
    for module, inputs, keys in computed:
        assert torch.equal(inputs, encoded)
        assert torch.equal(keys, F.linear(encoded, module.weight, module.bias))
    copied = getattr(packed_linear, "_PACKED_INT8" if precision == "int8" else "_PACKED_BF16")
    assert not any(module.weight in copied for module, _, _ in computed)  # no copy that nothing reads


def test_packed_weights_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="packed_weights must be True or False, got 'yes'"):
        SpeculativeDecoder(target=tiny_whisper(seed=0), drafter=SharedEncoderDrafter(model=decoder_of(tiny_whisper(seed=0))),
                           packed_weights="yes")
    toml = tmp_path / "plugins.toml"
    toml.write_text(f'[target]\nmodel = "{PAIR / "target"}"\npacked_weights = "no"\n\n[drafter]\nuse = "ngram"\n')
    with pytest.raises(ConfigError, match=r"plugins.toml: \[target\] packed_weights must be true or false, got 'no'"):
        SpecdecConfig.from_toml(toml)
    toml.write_text(f'[target]\nmodel = "{PAIR / "target"}"\npacked_weights = false\n\n[drafter]\nuse = "ngram"\n')
    assert SpecdecConfig.from_toml(toml).packed_weights is False


# --- a drafter's bfloat16 weights (matmul_precision) ---------------------------------------------



def test_bfloat16_wins_where_it_takes_at_most_the_margin_of_float32s_faster_path():
    """"auto" reads bfloat16 at a width where it beats the faster of torch's path and the packed one
    (padded as packed runs) by the margin, and nowhere else."""
    times = {1: (1.0, 0.8), 2: (2.0, 1.0), 3: (2.0, 0.5), 4: (2.0, 0.4), 8: (2.0, 0.6), 12: (2.0, 0.8), 16: (0.5, 1.0)}
    assert packed_linear.pad_widths(times) == {1: 4, 2: 4, 3: 4}  # so 1-3 rows run as 4 (0.4) in float32
    bfloat16 = {1: (0.3,), 2: (0.5,), 3: (0.3,), 4: (0.36,), 8: (0.5,), 12: (0.73,), 16: (0.44,)}
    # 1, 3: 0.3 <= 0.9 x 0.4; 2: 0.5 > 0.36; 4: 0.36 = 0.9 x 0.4; 8: 0.5 <= 0.54; 12: 0.73 > 0.72;
    # 16: 0.44 <= 0.9 x 0.5, torch's path being the faster float32 one there
    assert packed_linear.bfloat16_wins(times, bfloat16) == frozenset({1, 3, 4, 8, 16})
    weight = linear().weight
    assert packed_linear.bfloat16_at(weight, "medium") == frozenset(packed_linear.TRIAL_ROWS)
    assert packed_linear.bfloat16_at(weight, "highest") == frozenset()


@needs_bfloat16
@torch.no_grad()
def test_a_bfloat16_layer_computes_the_linear_layer_to_bfloat16s_rounding():
    layer = linear()
    everywhere = frozenset(packed_linear.TRIAL_ROWS)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 512)
        out = packed_linear._mixed_forward(layer, everywhere, frozenset(), {}, x)
        expected = F.linear(x, layer.weight, layer.bias)
        assert out.dtype == torch.float32 and out.shape == expected.shape
        assert not torch.equal(out, expected)  # bfloat16's products, not float32's
        assert torch.allclose(out, expected, rtol=0.05, atol=0.05 * float(expected.abs().mean()))
    x = torch.randn(2, 3, 512)  # a [batch, tokens, features] block, at a width it was not given bfloat16 for
    out = packed_linear._mixed_forward(layer, frozenset({1}), frozenset(), {}, x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    assert layer.weight in packed_linear._PACKED_BF16 and packed_linear._PACKED_BF16[layer.weight][1].dtype == torch.bfloat16


def float32_pair():
    """The bundled pair in float32, two left-padded prompts and the target's greedy 24 tokens for them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR, local_files_only=True, padding_side="left")
    target, draft = (AutoModelForCausalLM.from_pretrained(PAIR / name, dtype=torch.float32, local_files_only=True).eval()
                     for name in ("target", "draft"))
    batch = tokenizer(["def fibonacci(n):\n", "import os\n\n\ndef main("], return_tensors="pt", padding=True)
    return target, draft, batch, target.generate(**batch, max_new_tokens=24, do_sample=False)


def generates_as_target(decoder, target, batch, expected, label):
    """``decoder``'s output equals the target's greedy one for the first prompt alone and for both;
    the output of the batch of two."""
    for rows in (slice(0, 1), slice(0, 2)):
        inputs = {name: value[rows] for name, value in batch.items()}
        out = decoder.generate(**inputs, max_new_tokens=24)
        reference = expected[rows] if rows.stop == 2 else target.generate(**inputs, max_new_tokens=24, do_sample=False)
        assert torch.equal(out.sequences, reference[:, : out.sequences.shape[1]]), label
    return out


@needs_pair
@needs_bfloat16
@torch.no_grad()
def test_a_draft_on_bfloat16_weights_stays_exact_and_the_target_never_reads_them(monkeypatch):
    """The bundled pair in float32: with ``matmul_precision`` "medium", or "auto" where bfloat16 is
    timed faster, the draft model's steps read bfloat16 copies of its weights and the output is
    generate's at batch 1 and 2; the draft's precision never copies the target's weights to
    bfloat16 (its LM head's screen does, for greedy verifies: tests/test_screened_head.py, off
    here); "highest", and "auto" where bfloat16 is timed slower, leave the draft in float32."""
    target, draft, batch, expected = float32_pair()
    for precision, faster, copied in (("highest", True, False), ("medium", False, True), ("auto", True, True),
                                      ("auto", False, False)):
        pin_packing(monkeypatch, start=4, smallest=1 << 20, one_row=True, bfloat16=faster)  # both LM heads
        monkeypatch.setattr(packed_linear, "_PACKED_BF16", packed_linear.WeakIdKeyDictionary())
        monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.WeakIdKeyDictionary())
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft, matmul_precision=precision),
                                     policy=ConstantLookahead(k=3), screened_head=False)
        out = generates_as_target(decoder, target, batch, expected, precision)
        assert out.stats.accepted > 0
        assert (draft.lm_head.weight in packed_linear._PACKED_BF16) is copied, (precision, faster)
        # one copy, not two: bfloat16 at every width leaves no float32 packed copy of the draft's head
        assert (draft.lm_head.weight in packed_linear._PACKED) is not copied, (precision, faster)
        assert target.lm_head.weight in packed_linear._PACKED
        assert not any(parameter in packed_linear._PACKED_BF16 for parameter in target.parameters())


@needs_bfloat16
def test_a_hidden_state_head_on_bfloat16_weights_stays_exact(monkeypatch):
    """A float32 tiny Llama with a trained head whose every linear layer, the readout included, reads
    bfloat16 weights ("medium"): generate's output on a ragged batch, and the head did draft."""
    from .test_hidden_state import trained_head

    pin_packing(monkeypatch, start=2, smallest=1, one_row=True)  # every layer of these tiny models
    target = copy.deepcopy(tiny_model("llama")).float()
    head = copy.deepcopy(trained_head("llama"))
    ids, mask = left_padded_prompts([9, 3, 14, 6], vocab=target.config.vocab_size)
    expected = greedy_reference(target, ids, mask, 20)
    drafter = HiddenStateDrafter(head, matmul_precision="medium")
    out = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3)).generate(
        ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(out.sequences, expected)
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert head.readout_layer.weight in packed_linear._PACKED_BF16 and head.fc.weight in packed_linear._PACKED_BF16
    assert not any(parameter in packed_linear._PACKED_BF16 for parameter in target.parameters())


def test_a_bfloat16_timing_is_kept_beside_the_float32_ones(monkeypatch, tmp_path):
    """A shape's bfloat16 times go to the same file under their own key, one time per width; writing
    a float32 entry later keeps them, and a damaged bfloat16 entry is timed again."""
    measurements_in(monkeypatch, tmp_path)
    timed = []
    bfloat16 = {rows: (0.25,) for rows in packed_linear.TRIAL_ROWS}
    monkeypatch.setattr(packed_linear, "time_shape_bfloat16", lambda weight: timed.append("bfloat16") or bfloat16)
    monkeypatch.setattr(packed_linear, "time_shape",
                        lambda weight: timed.append("float32") or {rows: (1.0, 0.5) for rows in packed_linear.TRIAL_ROWS})
    weight = linear().weight
    assert packed_linear.bfloat16_at(weight, "auto") == frozenset(packed_linear.TRIAL_ROWS)
    record = json.loads(packed_linear.measurements_file().read_text())
    key = packed_linear._machine_key(tuple(weight.shape))
    assert record[key + "|bfloat16"] == {str(rows): [0.25] for rows in packed_linear.TRIAL_ROWS}
    assert sorted(record) == [key, key + "|bfloat16"] and timed == ["float32", "bfloat16"]
    monkeypatch.setattr(packed_linear, "_MEASURED", {})
    monkeypatch.setattr(packed_linear, "_MEASURED_BF16", {})  # a new process: read, not timed
    assert packed_linear.bfloat16_at(weight, "auto") == frozenset(packed_linear.TRIAL_ROWS) and len(timed) == 2
    monkeypatch.setattr(packed_linear, "_MEASURED_BF16", {})
    packed_linear.measurements_file().write_text(json.dumps({**record, key + "|bfloat16": {"1": [0.25, 0.25]}}))
    assert packed_linear.bfloat16_at(weight, "auto") == frozenset(packed_linear.TRIAL_ROWS) and timed[-1] == "bfloat16"
    assert len(timed) == 3


@needs_bfloat16
def test_a_first_bfloat16_timing_is_said_once_naming_the_model(monkeypatch, caplog):
    """As float32's: the first request that times a model's shapes in bfloat16 says so (how many, which
    model, where they are kept) and how long it took; the next one, its shapes known, says nothing."""
    import logging

    pin_packing(monkeypatch, start=2, smallest=1 << 16, one_row=True, bfloat16=True)
    model = torch.nn.Sequential(linear(), linear(512, 2048), linear())  # two shapes
    with caplog.at_level(logging.INFO, logger="specdec.core.packed_linear"):
        packed_linear.pack(model, "auto")
    said = [record.getMessage() for record in caplog.records if "bfloat16" in record.getMessage()]
    assert len(said) == 1 and said[0].startswith("timing 2 weight shapes of Sequential in bfloat16")
    assert str(packed_linear.measurements_file()) in said[0]
    assert any(record.getMessage().startswith("timed in") for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specdec.core.packed_linear"):
        packed_linear.pack(torch.nn.Sequential(linear()), "auto")  # a shape already timed
    assert not caplog.records


@needs_bfloat16
def test_the_bfloat16_timing_times_every_width():
    times = REAL_TIME_SHAPE_BFLOAT16(torch.zeros(256, 512))
    assert sorted(times) == list(packed_linear.TRIAL_ROWS) and all(len(t) == 1 and t[0] > 0 for t in times.values())


def test_matmul_precision_is_checked(tmp_path):
    for drafter in (lambda value: ModelDrafter(decoder_of(tiny_whisper(seed=0)), matmul_precision=value),
                    lambda value: HiddenStateDrafter("head.safetensors", matmul_precision=value)):
        with pytest.raises(ConfigError, match=r"option 'matmul_precision' must be one of 'highest', 'medium', 'auto', "
                                              r"'int8', got 'bf16'"):
            drafter("bf16")
    toml = tmp_path / "plugins.toml"
    toml.write_text(f'[target]\nmodel = "{PAIR / "target"}"\n\n[drafter]\nuse = "model"\nmodel = "{PAIR / "draft"}"\n'
                    'matmul_precision = "low"\n')
    with pytest.raises(ConfigError, match=r"drafter 'model': option 'matmul_precision' must be one of .*got 'low'"):
        SpeculativeDecoder.from_config(SpecdecConfig.from_toml(toml))


@needs_int8
def test_an_int8_layer_computes_the_linear_layer_to_int8s_rounding():
    layer = linear()
    for rows in (1, 3, 8):
        x = torch.randn(rows, 512)
        with torch.no_grad():
            out = packed_linear._int8_forward(layer, x)
            expected = F.linear(x, layer.weight, layer.bias)
        assert out.dtype == torch.float32 and out.shape == expected.shape
        assert not torch.equal(out, expected)  # int8's products, not float32's
        assert float((out - expected).norm() / expected.norm()) < 0.05  # 7-bit rows, 8-bit weights
    x = torch.randn(2, 3, 512)  # a [batch, tokens, features] block
    with torch.no_grad():
        assert packed_linear._int8_forward(layer, x).shape == (2, 3, 2048)
    assert torch.equal(packed_linear._int8_forward(layer, x), F.linear(x, layer.weight, layer.bias))  # training: float32
    assert layer.weight in packed_linear._PACKED_INT8
    kept = packed_linear.Int8Linear(layer)  # the same layer kept only in int8: the same numbers
    with torch.no_grad():
        assert torch.equal(kept(x), packed_linear._int8_forward(layer, x))
        wide = kept(x.double())  # a draft cast to float64 after loading: its rows read in float32
        assert wide.dtype == torch.float64 and torch.equal(wide, packed_linear._int8_forward(layer, x).double())


@needs_pair
@needs_int8
@torch.no_grad()
def test_a_draft_on_int8_weights_stays_exact_and_the_target_never_reads_them(monkeypatch):
    """The bundled pair in float32 with ``matmul_precision = "int8"``: the draft's steps read int8
    weights and the output is generate's at batch 1 and 2; none of the target's weights are
    quantised. Without fbgemm the draft runs as "auto" and nothing is quantised."""
    target, draft, batch, expected = float32_pair()
    for fbgemm in (True, False):
        pin_packing(monkeypatch, start=4, smallest=1 << 20, one_row=True)
        monkeypatch.setattr(packed_linear, "_PACKED_INT8", packed_linear.WeakIdKeyDictionary())
        monkeypatch.setattr(packed_linear, "int8_available", lambda: fbgemm)
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft, matmul_precision="int8"),
                                     policy=ConstantLookahead(k=3), screened_head=False)
        out = generates_as_target(decoder, target, batch, expected, fbgemm)
        assert out.stats.accepted > 0
        assert (draft.lm_head.weight in packed_linear._PACKED_INT8) is fbgemm
        assert (draft.model.layers[0].mlp.up_proj.weight in packed_linear._PACKED_INT8) is fbgemm
        assert not any(parameter in packed_linear._PACKED_INT8 for parameter in target.parameters())


def int8_and_float32_layers(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """The names of ``model``'s layers kept only in int8, and of its ``nn.Linear`` ones."""
    int8 = {name for name, module in model.named_modules() if type(module) is packed_linear.Int8Linear}
    return int8, {name for name, module in model.named_modules() if type(module) is torch.nn.Linear}


@needs_int8
@torch.no_grad()
def test_a_whisper_draft_loaded_from_its_file_keeps_only_its_int8_weights(monkeypatch, tmp_path):
    """Under "int8", a shared-encoder draft that the drafter loads from its file keeps its linear
    layers only in int8 (``Int8Linear``: no float32 copy is left), its frozen cross-attention keys
    and values are the target's own parameters (held once), and it drafts what the same draft passed
    in (its float32 kept, its steps on int8 copies) drafts: generate's transcript, the same drafts
    accepted. A draft passed in is the caller's and keeps its float32 layers; without fbgemm a loaded
    one keeps them too."""
    from specdec.drafters.shared_encoder_draft import build_draft, load_shared_encoder_draft, save_shared_encoder_draft

    pin_packing(monkeypatch, smallest=0, one_row=True)
    target = tiny_whisper(seed=0, decoder_layers=2).float()
    draft = build_draft(target, torch.arange(target.config.vocab_size), init_layers=[0, 1])
    saved = save_shared_encoder_draft(draft, tmp_path / "draft", dtype=torch.float32)
    x = features(4, seed=11).float()
    prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 4)
    reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=16)

    def run(model):
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=model, matmul_precision="int8"),
                                     policy=ConstantLookahead(k=3))
        out = decoder.generate(prompt, input_features=x, max_new_tokens=16)
        assert torch.equal(out.sequences, reference)
        return decoder.drafter.model, (out.stats.drafted, out.stats.accepted)

    loaded, stats = run(str(saved.parent))
    int8, float32 = int8_and_float32_layers(loaded)
    attention = {f"model.decoder.layers.{i}.encoder_attn.{name}" for i in (0, 1) for name in ("k_proj", "v_proj")}
    assert float32 == attention and len(int8) == 2 * 10 - len(attention) + 1  # 10 linear layers a layer, the head
    assert all(getattr(loaded.model.decoder.layers[i].encoder_attn, name).weight
               is getattr(target.model.decoder.layers[i].encoder_attn, name).weight for i in (0, 1) for name in ("k_proj", "v_proj"))
    assert run(loaded)[1] == stats  # the int8 draft passed in again (its head's width read off the int8 layer)
    passed_in, stats_passed_in = run(load_shared_encoder_draft(saved, target))
    assert stats == stats_passed_in and stats[1] > 0
    assert int8_and_float32_layers(passed_in) == (set(), float32 | int8)
    monkeypatch.setattr(packed_linear, "int8_available", lambda: False)
    without_fbgemm, _ = run(str(saved.parent))
    assert int8_and_float32_layers(without_fbgemm) == (set(), float32 | int8)


@needs_pair
@needs_int8
@torch.no_grad()
def test_a_draft_model_loaded_from_its_folder_keeps_only_its_int8_weights(monkeypatch):
    """The bundled pair's draft, given to the ``model`` drafter as its folder under "int8": its
    linear layers large enough to quantise are kept only in int8, and the output is generate's at
    batch 1 and 2 with the same drafts accepted as the same draft passed in in float32."""
    target, draft, batch, expected = float32_pair()
    outs = []
    for model in (str(PAIR / "draft"), draft):
        pin_packing(monkeypatch, start=4, smallest=1 << 20, one_row=True)
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(model, matmul_precision="int8"),
                                     policy=ConstantLookahead(k=3), screened_head=False)
        out = generates_as_target(decoder, target, batch, expected, model)
        outs.append((out.stats.drafted, out.stats.accepted))
        int8, _ = int8_and_float32_layers(decoder.drafter.model)
        quantisable = {name for name, module in draft.named_modules()
                       if type(module) is torch.nn.Linear and module.weight.numel() >= packed_linear.MIN_WEIGHT}
        assert int8 == (quantisable if isinstance(model, str) else set()) and quantisable
    assert outs[0] == outs[1] and outs[0][1] > 0


# --- packed_weights = false: copy-free routes ----------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("route", packed_linear.COPY_FREE_ROUTES)
@pytest.mark.parametrize("bias", [True, False])
def test_a_copy_free_route_computes_the_linear_layer_and_copies_nothing(route, bias):
    layer = linear(bias=bias)
    before = layer.weight.clone()
    routes = {width: route for width in packed_linear.TRIAL_ROWS if width >= 2}
    for shape in ((6, 512), (2, 3, 512), (1, 16, 512)):
        x = torch.randn(*shape)
        out = packed_linear._copy_free_forward(layer, routes, x)
        expected = F.linear(x, layer.weight, layer.bias)
        assert out.shape == expected.shape and out.is_contiguous()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    x = torch.randn(1, 512)  # one row: torch's own, bit for bit
    assert torch.equal(packed_linear._copy_free_forward(layer, routes, x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer.weight, before)
    assert not packed_linear.has_packed_copy(layer.weight) and layer.weight not in packed_linear._PACKED_BF16


def test_a_copy_free_route_is_taken_where_it_wins_by_the_margin():
    torch_path = {1: (1.0, 0.1), 2: (1.0, 0.1), 3: (1.0, 0.1), 4: (2.0, 0.1), 8: (2.0, 0.1), 12: (2.0, 0.1),
                  16: (1.0, 0.1)}
    copy_free = {1: (0.1, 0.1), 2: (0.5, 0.8), 3: (0.95, 0.91), 4: (1.9, 1.0), 8: (1.0, 1.8), 12: (2.0, 1.8),
                 16: (0.95, 2.0)}
    # one row never (a target's plain step stays generate's own); 3: 0.91 > 0.9 x 1.0; 12: 1.8 = 0.9 x 2.0
    assert packed_linear.copy_free_wins(torch_path, copy_free) == {
        2: "transposed", 4: "oneDNN", 8: "transposed", 12: "oneDNN"}
    # what packed weights would have cost does not matter: none is made to run packed
    slower_packed = {rows: (seconds, 99.0) for rows, (seconds, _) in torch_path.items()}
    assert packed_linear.copy_free_wins(slower_packed, copy_free) == packed_linear.copy_free_wins(torch_path, copy_free)


def test_the_copy_free_timing_times_both_routes_at_every_width():
    times = REAL_TIME_SHAPE_COPY_FREE(torch.zeros(256, 512))
    assert sorted(times) == list(packed_linear.TRIAL_ROWS)
    assert all(len(t) == len(packed_linear.COPY_FREE_ROUTES) and min(t) > 0 for t in times.values())


@torch.no_grad()
def test_a_copy_free_timing_is_kept_beside_the_packed_ones(monkeypatch, tmp_path):
    measurements_in(monkeypatch, tmp_path)
    timed = []
    monkeypatch.setattr(packed_linear, "time_shape",
                        lambda weight: timed.append("packed") or {rows: (1.0, 0.5) for rows in packed_linear.TRIAL_ROWS})
    monkeypatch.setattr(packed_linear, "time_shape_copy_free",
                        lambda weight: timed.append("copy-free") or {rows: (0.5, 0.7) for rows in packed_linear.TRIAL_ROWS})
    weight = linear().weight
    everywhere = {rows: "transposed" for rows in packed_linear.TRIAL_ROWS if rows >= 2}
    assert packed_linear.copy_free_routes(weight) == everywhere and timed == ["packed", "copy-free"]
    record = json.loads(packed_linear.measurements_file().read_text())
    key = packed_linear._machine_key(tuple(weight.shape))
    assert record[key + "|copy-free"] == {str(rows): [0.5, 0.7] for rows in packed_linear.TRIAL_ROWS}
    monkeypatch.setattr(packed_linear, "_MEASURED", {})
    monkeypatch.setattr(packed_linear, "_MEASURED_COPY_FREE", {})  # a new process: read, not timed
    assert packed_linear.copy_free_routes(weight) == everywhere and len(timed) == 2


@needs_pair
@torch.no_grad()
@pytest.mark.parametrize("route", packed_linear.COPY_FREE_ROUTES)
def test_the_bundled_pair_without_packed_weights_verifies_on_copy_free_routes_and_equals_generate(monkeypatch, route):
    """``packed_weights = false``: verify blocks take the copy-free route measured faster, no packed
    copy of any weight is made, the output is generate's at batch 1 and 4, and plain steps stay
    generate's own."""
    pin_packing(monkeypatch, copy_free=route)
    calls = []
    original = packed_linear._copy_free_forward

    def counting(module, routes, x):
        rows = x.numel() // x.shape[-1]
        calls.append((module.weight, rows, routes.get(packed_linear.trial_width(rows))))
        return original(module, routes, x)

    monkeypatch.setattr(packed_linear, "_copy_free_forward", counting)
    target, batch = float32_pair_and_prompts()
    decoder = SpeculativeDecoder.from_config(SpecdecConfig.from_toml(REPO_TOML), target=target)
    decoder.packed_weights = False
    equals_generate_at_1_and_4(decoder, target, batch)
    verified = [(rows, taken) for weight, rows, taken in calls if weight is target.lm_head.weight]
    assert any(taken == route for _, taken in verified)  # the head's verifies took the route
    assert all(rows >= 4 for rows, taken in verified if taken)  # where it was measured faster, only
    assert not any(p in packed_linear._PACKED for p in target.parameters())  # no packed copy made
