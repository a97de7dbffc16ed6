"""The tests' shared helpers: tiny named models built from configs (float64, so numeric ties cannot
hide bugs), left-padded batches, a perturbed-copy draft, and an observer that records every step."""

from __future__ import annotations

import copy
import functools
import weakref

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from specdec.core import packed_linear
from specdec.core.model_cache import cache_root
from specdec.observers import Observer

# The test machines share two cores: under contention torch's default thread pool makes these
# tiny models up to 30x slower, and every model here is tiny.
torch.set_num_threads(1)

REAL_TIME_SHAPE = packed_linear.time_shape
REAL_TIME_SHAPE_BFLOAT16 = packed_linear.time_shape_bfloat16
REAL_TIME_SHAPE_COPY_FREE = packed_linear.time_shape_copy_free
REAL_RECORDED, REAL_RECORD = packed_linear._recorded, packed_linear._record


def finished_requests(monkeypatch) -> dict:
    """What each ``CachedModel`` held as its last request ended, by role ("target", "draft"): its
    ``slots`` and its runner's ``encoder_outputs``. The decoder lets them go then
    (``CachedModel.end``); a test that looks into a finished request's caches reads them here."""
    from types import SimpleNamespace

    from specdec.core.cached_model import CachedModel

    kept = {}
    end = CachedModel.end

    def keeping(self, state):
        kept[self.role] = SimpleNamespace(slots=self.slots, encoder_outputs=self.runner.encoder_outputs)
        end(self, state)

    monkeypatch.setattr(CachedModel, "end", keeping)
    return kept


def pin_packing(monkeypatch, start: int | None = 4, smallest: int = 3 << 18, one_row: bool = False,
                bfloat16: bool = False, copy_free: str | None = None) -> None:
    """Make packed_linear's timing say that packed weights are faster from ``start`` rows (None:
    never), and at one row (a drafter's step) with ``one_row``, for weights of ``smallest`` elements
    or more, and never for smaller ones; and that bfloat16 weights are slower (a drafter's default
    ``matmul_precision = "auto"`` keeps float32), or with ``bfloat16`` faster still at every width for
    those weights. The copy-free routes (``packed_weights = false``) are slower than torch's path, or
    with ``copy_free`` (a route's name) that route is faster where packed is."""

    def timed(weight):  # torch's path cheap below start, so that padding to start rows does not pay either
        wins = start is not None and weight.numel() >= smallest
        return {rows: (1.0, 0.5) if wins and (rows >= start or rows == 1 and one_row) else (0.5, 1.0)
                for rows in packed_linear.TRIAL_ROWS}

    def timed_bfloat16(weight):
        wins = bfloat16 and start is not None and weight.numel() >= smallest
        return {rows: (0.2,) if wins else (2.0,) for rows in packed_linear.TRIAL_ROWS}

    def timed_copy_free(weight):  # (transposed, oneDNN)
        fast = tuple(0.25 if route == copy_free else 2.0 for route in packed_linear.COPY_FREE_ROUTES)
        return {rows: fast if timed(weight)[rows] == (1.0, 0.5) else (2.0, 2.0) for rows in packed_linear.TRIAL_ROWS}

    monkeypatch.setattr(packed_linear, "_MEASURED", {})
    monkeypatch.setattr(packed_linear, "_MEASURED_BF16", {})
    monkeypatch.setattr(packed_linear, "_MEASURED_COPY_FREE", {})
    monkeypatch.setattr(packed_linear, "_TOO_BIG_TO_PACK", weakref.WeakSet())
    for cache in ("_LINEARS", "_CANDIDATES", "_BF16_PLANS", "_INT8_PLANS", "_COPY_FREE_PLANS"):  # models cached across tests
        monkeypatch.setattr(packed_linear, cache, weakref.WeakKeyDictionary())
    monkeypatch.setattr(packed_linear, "time_shape", timed)
    monkeypatch.setattr(packed_linear, "time_shape_bfloat16", timed_bfloat16)
    monkeypatch.setattr(packed_linear, "time_shape_copy_free", timed_copy_free)
    monkeypatch.setattr(packed_linear, "_recorded", lambda: {})  # never what this machine measured before
    monkeypatch.setattr(packed_linear, "_record", lambda key, times: None)
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT", min(packed_linear.MIN_WEIGHT, smallest))


@pytest.fixture(autouse=True)
def policy_memory_kept_per_test(monkeypatch, tmp_path_factory):
    """``specdec generate`` and ``transcribe`` keep ``cost-aware``'s memory (the default policy) in
    specdec's cache: each test gets a cache of its own, so that no test reads what another measured
    (or writes into the user's cache), with the models folder linked to the real one so that tests of
    fetched checkpoints still find them."""
    real = cache_root()
    root = tmp_path_factory.mktemp("specdec-cache")
    if real.is_dir():
        (root / "models").symlink_to(real, target_is_directory=True)
    monkeypatch.setenv("SPECDEC_CACHE", str(root))


@pytest.fixture(autouse=True)
def packing_as_on_the_xeon(monkeypatch):
    """Where packing starts is measured on the machine that decodes (core/packed_linear.py); the suite
    pins it to what the project's Xeon measured (from 4 rows, weights of 3 MiB and more), so that no
    test depends on the CPU it runs on. tests/test_packed_linear.py times the real thing."""
    pin_packing(monkeypatch)


VOCAB = 61
EOS = 2
PAD = 0


@functools.cache
def tiny_model(arch: str, layers: int = 2, seed: int = 0, vocab: int = VOCAB, context: int = 128):
    """A random float64 model; cached, so treat it as read-only."""
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=context,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=context,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model.double().eval()


def left_padded_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB):
    """A left-padded batch with one random prompt of each length (tokens avoid eos and pad)."""
    generator = torch.Generator().manual_seed(seed)
    return left_padded([torch.randint(3, vocab, (length,), generator=generator).tolist() for length in lengths], PAD)


def greedy_reference(model, input_ids, mask, max_new_tokens, **kwargs):
    return model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture
def llama_draft():
    return tiny_model("llama", layers=1, seed=1)


class Recorder(Observer):
    """Keeps every Step the loop reports."""

    name = "recorder"

    def __init__(self):
        self.steps = []

    def on_step(self, state, step):
        self.steps.append(step)


def tiny_llama(seed: int, vocab: int = 8, layers: int = 1, dtype=torch.float32, init: float = 0.5) -> LlamaForCausalLM:
    """A 32-wide Llama whose next-token distributions are far from uniform (``init`` scales the weights).

    Different seeds give a target and a draft that disagree often, so rejections, residual draws
    and bonus tokens all happen.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return model


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of token lists padded on the left."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return input_ids, mask


def perturbed_copy(model, noise: float, seed: int = 1):
    """A draft close to ``model``: its matrices plus Gaussian noise of ``noise`` times their spread.

    Around 0.15 the target accepts about half the drafts, so rejections and bonus tokens both happen.
    """
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.dim() > 1:
                noise_ = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
                parameter.add_(noise_ * noise * parameter.std())
    return draft


def drafts_and_budgets(steps, max_tokens: int, new_tokens: int):
    """For every row that drafted in every recorded Step: ``(step, position, allowed)``, where
    ``allowed`` is the most the policy could let it draft (``max_tokens``, capped by the loop at
    the row's remaining tokens minus one), so a shorter draft is one the policy stopped."""
    committed: dict[int, int] = {}
    for step in steps:
        for b, row in enumerate(step.rows_host.tolist()):
            done = committed.get(row, 0)
            if int(step.drafted_host[b]):
                yield step, b, min(max_tokens, new_tokens - done - 1)
            committed[row] = done + int(step.appended_host[b])


def run_on_a_terminal(script: str, **env) -> tuple[int, str]:
    """Run the Python ``script`` with stdin, stdout and stderr on a real pseudo-terminal (100 columns,
    colour allowed, ``env`` added); its exit code and everything it wrote there."""
    import os
    import pty
    import select
    import subprocess
    import sys

    leader, follower = pty.openpty()
    environment = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", **env}
    environment.pop("NO_COLOR", None)
    process = subprocess.Popen([sys.executable, "-c", script], stdin=follower, stdout=follower, stderr=follower,
                               env=environment)
    os.close(follower)
    seen = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    return process.wait(timeout=60), seen.decode(errors="replace")
