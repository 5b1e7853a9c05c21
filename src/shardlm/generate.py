"""Generating text from a model on its mesh: a jitted prefill, then one jitted decode step per token.

With the KV cache (the default), the prefill runs the prompts once (right-padded to a length bucket, so one compile
serves every prompt up to that length) and fills a fixed-size cache of the whole context; each decode step feeds
one token per row at that row's own position, so the step's shapes never change and it compiles once. The cache is
donated to each step and updated in place. Without the cache (`use_cache=False`, seed 002's method) every step
re-runs the model on the whole padded context: quadratic work, kept for comparison and debugging.

The host loop dispatches step t+1 before it reads step t's tokens (they stay on the device as step t+1's input),
so reading tokens for streaming and end-of-text checks overlaps the device's work. A batch stops when every row has
produced the end-of-text token, its token budget, or the end of the context.

A model shardlm did not write (a `forward(model, tokens) -> logits` is given) has no cache to fill: it generates
the second way, running the whole context for each token and reading each row's logits at its position, which any
causal model that maps tokens [batch, context] to logits supports.

Everything runs on the mesh the parameters are sharded on: rows are split over data x fsdp (a batch is padded to
a multiple of that), heads and the cache over tensor, exactly as in training. The sequence is not split: a
decode step has one token per row, so on a mesh with a context axis (a long-context run's own) the context
devices hold the same rows and compute them as replicas, and the prefill does the same (prompts are short next
to the training sequences context parallelism is for). Nor are the layers pipelined: on a mesh with pipeline
stages every stage's devices are given every layer and serve as replicas too.
"""

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from shardlm.errors import ShardlmError
from shardlm.models.stack import LayerCache
from shardlm.models.stack import unstacked
from shardlm.sampling import Sampling, next_tokens
from shardlm.sharding import (
    batch_sharding,
    generation_rules,
    logical_to_spec,
    replicated,
    state_shardings,
    use_mesh_rules,
)
from shardlm.sharding.rules import axis_degree

MIN_BUCKET = 16  # prompt lengths are padded to 16, 32, 64, ... (capped at the context): one prefill compile each


def bucket(length: int, context: int) -> int:
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return min(b, context)


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    ids: list[int]  # the generated tokens, without the end-of-text token
    stop: str  # "eot" (end-of-text token), "max_tokens", or "context" (the context is full)
    seconds: float  # from the start of the batch's prefill to this sample's last token
    first_token_s: float  # from the start of the prefill to the first new token (time to first token)

    @property
    def tokens_per_s(self) -> float:
        """End to end: new tokens over `seconds`, the prefill included."""
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0


class Generator:
    """Compiled generation for one model on one mesh; reuse it for many calls (compiles are kept).

    `graphdef`, `state`: the model's (`nnx.split(model)`), `state` sharded on `mesh`. `max_batch` bounds the rows
    decoded together (the cache is rows x context x layers x 2 x d_model values). For a model shardlm did not
    write, `forward(model, tokens) -> logits` runs it (without a cache), `context` is its sequence length and
    `vocab` the tokenizer's vocabulary (logits beyond it, a padded output, are never sampled).
    """

    def __init__(self, graphdef, state, mesh, *, eot_id: int, use_cache: bool = True, max_batch: int = 32,
                 forward: Callable | None = None, context: int | None = None, vocab: int | None = None):
        if forward is None:  # shardlm's own model decodes with its blocks one module per layer (`unstacked`)
            if mesh.shape.get("stage", 1) > 1:  # every stage's devices hold every layer (`generation_rules`)
                state = _placed(state, state_shardings(state, mesh, generation_rules()))
            graphdef, state = nnx.split(unstacked(nnx.merge(graphdef, state)))
        self.graphdef, self.mesh = graphdef, mesh
        # The parameters travel as a flat list of arrays: flattening an nnx.State (its Variables) at every call
        # costs ~2 ms of host time per decode step for a 6-layer model.
        self.params, self.params_def = jax.tree.flatten(state)
        self.eot_id, self.use_cache, self.forward, self.vocab = eot_id, use_cache, forward, vocab
        if forward is None:
            model = nnx.merge(graphdef, state)
            self.context, self.n_layers = model.context, model.n_layers
            self.cache_layout = model.cache_layout  # the cache's logical axes (a latent cache's differ)
            self.cache_kind = model.cache_kind()  # what it holds per token and layer, said in the model's terms
        elif use_cache or context is None:
            raise ValueError("a model run by `forward` generates without a cache, over `context` tokens")
        else:
            self.context, self.n_layers = context, 0
        self.row_sharding = NamedSharding(mesh, logical_to_spec(("batch",), mesh=mesh))
        # the batch's split (data x fsdp x expert): a batch is padded to a multiple of it
        self.rows_multiple = axis_degree(mesh, self.row_sharding.spec[0])
        self.max_batch = max(self.rows_multiple, max_batch // self.rows_multiple * self.rows_multiple)
        self.compile_s = 0.0  # total time spent compiling, for reports
        self.cache_bytes_per_token = 0  # measured once a batch has run with the cache
        self._compiled: dict = {}

    def generate(self, prompts: list[list[int]], max_new: int, sampling: Sampling, *, seed: int = 0,
                 on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
        """Continue each prompt (token ids, 1 to context-1 of them) by up to `max_new` tokens. Sample i's randomness
        is (seed, i, position). `on_token(i, token)` is called as each token reaches the host."""
        if max_new < 1:
            raise ValueError(f"max_new must be >= 1, not {max_new}")
        max_new = min(max_new, self.context)  # no row can take more
        for ids in prompts:
            if not 0 < len(ids) < self.context:
                raise ValueError(f"a prompt must hold 1 to {self.context - 1} tokens, not {len(ids)}")
        out: list[Completion] = []
        for first in range(0, len(prompts), self.max_batch):
            out += self._batch(prompts[first:first + self.max_batch], first, max_new, sampling, seed, on_token)
        return out

    # --- one batch --------------------------------------------------------------------------------------------

    def _batch(self, prompts, first, max_new, sampling, seed, on_token) -> list[Completion]:
        n = len(prompts)
        rows = -(-n // self.rows_multiple) * self.rows_multiple
        lengths = np.array([len(p) for p in prompts] + [len(prompts[0])] * (rows - n), np.int32)
        limits = np.minimum(max_new, self.context - lengths)
        width = bucket(int(lengths.max()), self.context) if self.use_cache else self.context
        tokens = np.zeros((rows, width), np.int32)
        for r, ids in enumerate(prompts + [prompts[0]] * (rows - n)):
            tokens[r, : len(ids)] = ids
        prefill, decode = self._compile(rows, width, sampling)
        put = jax.device_put
        args = (put(tokens, batch_sharding(self.mesh)), put(lengths, self.row_sharding),
                put(np.arange(first, first + rows, dtype=np.int32), self.row_sharding),
                put(np.uint32(seed % 2**32), replicated(self.mesh)))

        t0 = time.perf_counter()
        tok, pos, carry = prefill(self.params, *args)
        if self.use_cache:  # what the cache holds per token, read off the arrays themselves
            self.cache_bytes_per_token = sum(a.nbytes for a in jax.tree.leaves(carry)) // (rows * self.context)
        rows_arg, seed_arg = args[2], args[3]
        generated: list[list[int]] = [[] for _ in range(n)]
        stops: list[str | None] = [None] * n
        seconds = [0.0] * n
        steps, nxt = int(limits[:n].max()), None
        for step in range(steps):
            if step + 1 < steps:  # dispatch the next step before reading this one's tokens
                nxt, pos, carry = decode(self.params, tok, pos, rows_arg, seed_arg, carry)
            ids = np.asarray(tok)
            now = time.perf_counter()
            if step == 0:
                first_token_s = now - t0
            for r in range(n):
                if stops[r] is not None:
                    continue
                t = int(ids[r])
                if t == self.eot_id:
                    stops[r] = "eot"
                else:
                    generated[r].append(t)
                    if on_token is not None:
                        on_token(first + r, t)
                    if len(generated[r]) == limits[r]:
                        stops[r] = "max_tokens" if limits[r] == max_new else "context"
                if stops[r] is not None:
                    seconds[r] = now - t0
            if all(s is not None for s in stops):
                break
            tok = nxt
        return [Completion(list(p), g, s, sec, first_token_s)
                for p, g, s, sec in zip(prompts, generated, stops, seconds)]

    # --- compiled functions -----------------------------------------------------------------------------------

    def compile_for(self, rows: int, width: int, sampling: Sampling):
        """The compiled (prefill, decode) for `rows` prompts padded to `width` tokens: what `generate` runs. With
        an abstract `state` (shapes and shardings) on a target's devices, a compile for that target."""
        return self._compile(rows, width, sampling)

    def _compile(self, rows: int, width: int, sampling: Sampling):
        """The (prefill, decode) executables for this batch shape and sampling, compiled ahead of time once: a
        prefill per prompt-length bucket, one decode step for all of them."""
        key = (rows, width, sampling)
        if key not in self._compiled:
            t = time.perf_counter()
            self._compiled[key] = self._build(rows, width, sampling)
            self.compile_s += time.perf_counter() - t
        return self._compiled[key]

    def _build(self, rows: int, width: int, sampling: Sampling):
        graphdef, mesh, context, use_cache = self.graphdef, self.mesh, self.context, self.use_cache
        row_s, tok_s = self.row_sharding, batch_sharding(mesh)
        # The host reads every row's new token. In a run of several processes a process holds only its rows, so
        # there the tokens come out replicated (a few bytes gathered per step).
        new_s = replicated(mesh) if jax.process_count() > 1 else row_s
        rules = generation_rules()  # context and stage devices serve as replicas (see the module docstring)
        carry_s = LayerCache(*(NamedSharding(mesh, logical_to_spec(axes, rules, mesh=mesh))
                               for axes in self.cache_layout)) if use_cache else tok_s

        model_of = lambda params: nnx.merge(graphdef, jax.tree.unflatten(self.params_def, params))  # noqa: E731
        forward, vocab = self.forward, self.vocab

        def logits_at(model, tokens, at):
            """[rows, 1, vocab]: each row's logits at its position `at` of the whole context."""
            if forward is None:
                return model(tokens, at=at)
            out = jnp.take_along_axis(forward(model, tokens), at[:, None, None], axis=1)
            return out[..., :vocab] if vocab else out

        def prefill(params, tokens, lengths, sample_rows, seed):
            model = model_of(params)
            with use_mesh_rules(mesh, rules):
                if use_cache:
                    logits, carry = model.prefill(tokens, model.init_cache(rows), at=lengths - 1)
                else:
                    logits, carry = logits_at(model, tokens, lengths - 1), tokens
            tok = next_tokens(logits[:, 0], sampling, seed, sample_rows, lengths)
            return tok, lengths, carry

        def decode(params, tok, pos, sample_rows, seed, carry):
            model = model_of(params)
            at = jnp.minimum(pos, context - 1)  # rows already finished may run past the context; ignored
            with use_mesh_rules(mesh, rules):
                if use_cache:
                    logits, carry = model.decode(tok[:, None], at, carry)
                else:  # write the token into the padded context and re-run all of it
                    carry = jnp.where(jnp.arange(context) == at[:, None], tok[:, None], carry)
                    logits = logits_at(model, carry, at)
            return next_tokens(logits[:, 0], sampling, seed, sample_rows, at + 1), pos + 1, carry

        abstract = lambda shape, dtype, s: jax.ShapeDtypeStruct(shape, dtype, sharding=s)  # noqa: E731
        prompt_arg = abstract((rows, width), jnp.int32, tok_s)
        row_arg = abstract((rows,), jnp.int32, row_s)
        seed_arg = abstract((), jnp.uint32, replicated(mesh))
        prefill_args = (self.params, prompt_arg, row_arg, row_arg, seed_arg)
        prefill_c = jax.jit(prefill, out_shardings=(new_s, row_s, carry_s)).lower(*prefill_args).compile()
        decode_key = ("decode", rows, sampling)  # the decode step's shapes do not depend on the prompt bucket
        if decode_key not in self._compiled:
            carry_arg = jax.tree.map(lambda a, s: abstract(a.shape, a.dtype, s),
                                     jax.eval_shape(prefill, *prefill_args)[2], carry_s)
            new_arg = abstract((rows,), jnp.int32, new_s)
            self._compiled[decode_key] = jax.jit(decode, out_shardings=(new_s, row_s, carry_s), donate_argnums=5
                                                 ).lower(self.params, new_arg, row_arg, row_arg, seed_arg,
                                                         carry_arg).compile()
        return prefill_c, self._compiled[decode_key]


def _placed(state, shardings):
    """`state` on `shardings`: arrays moved there, abstract arrays (a compile for a target) given them."""
    def place(a, s):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        return jax.device_put(a, s)

    return jax.tree.map(place, state, shardings)


# --- prompts and text -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prompt:
    text: str  # as given ("" = start a new document)
    ids: list[int]  # what the model continues: the text's tokens, or their end when truncated
    truncated: bool

    def shown(self, tokenizer) -> str:
        """The prompt as printed before its continuation: the text, or what was kept of it."""
        return self.text if not self.truncated else "..." + tokenizer.decode(self.ids)


def truncated_length(context: int, max_new: int) -> int:
    """What --truncate keeps of a prompt too long for the context: room for `max_new` new tokens, but never less
    than half the context of prompt."""
    return context - min(max_new, context // 2)


def encode_prompts(tokenizer, texts: list[str], context: int, max_new: int, truncate: bool
                   ) -> tuple[list[Prompt], list[str]]:
    """Tokenize prompts for a model of `context` tokens; returns them and notes for the user. A prompt that leaves
    no room for a new token (as long as the context or longer) is an error; with `truncate` such a prompt keeps its
    last `truncated_length(context, max_new)` tokens instead. Prompts that fit are never cut."""
    prompts, short = [], 0
    name = (lambda i: "the prompt") if len(texts) == 1 else (lambda i: f"prompt {i + 1}")
    keep = truncated_length(context, max_new)
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text) if text else [tokenizer.eot_id]  # nothing: the model starts a new document
        if truncate and len(ids) >= context:
            prompts.append(Prompt(text, ids[-keep:], True))
            continue
        if len(ids) >= context:
            raise ShardlmError(f"{name(i)} is {len(ids)} tokens and the model's context is {context}: shorten it, "
                               "or pass --truncate to keep its end")
        short += len(ids) + max_new > context
        prompts.append(Prompt(text, ids, False))
    notes = []
    cut = [p for p in prompts if p.truncated]
    if cut:
        notes.append(f"{'the prompt was' if len(texts) == 1 else f'{len(cut)} prompts were'} cut to the last "
                     f"{keep} tokens (--truncate)")
    if short:
        room = context - len(prompts[0].ids)
        notes.append(f"the context holds {room} new tokens after the prompt; generating that many" if len(texts) == 1
                     else f"{short} prompts leave fewer than --max-tokens positions in the context; their samples "
                          "stop at its end")
    return prompts, notes


def read_prompts_file(path: str) -> list[str]:
    """One prompt per non-empty line; in a .jsonl file each line is {"prompt": TEXT} (prompts with newlines)."""
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ShardlmError(f"--prompts-file {p} is not a file; pass a text file with one prompt per line")
    try:
        numbered = [(n, line) for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    except UnicodeDecodeError as e:
        raise ShardlmError(f"--prompts-file {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    lines = [line for _, line in numbered]
    if p.suffix == ".jsonl":
        texts = []
        for n, line in numbered:
            try:
                texts.append(json.loads(line)["prompt"])
                assert isinstance(texts[-1], str)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise ShardlmError(f'line {n} of {p} is not a JSON object with a "prompt" string') from None
        lines = texts
    if not lines:
        raise ShardlmError(f"--prompts-file {p} holds no prompts")
    return lines


class IncrementalText:
    """Turns tokens arriving one by one into text as soon as it is complete: a character whose UTF-8 bytes span
    several tokens is held back until its last byte arrives (printing token by token would show U+FFFD)."""

    def __init__(self, tokenizer, emit: Callable[[str], None]):
        self.tokenizer, self.emit = tokenizer, emit
        self.ids: list[int] = []
        self.sent = 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._send(text)

    def flush(self) -> None:
        self._send(self.tokenizer.decode(self.ids))

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            self.emit(text[self.sent:])
            self.sent = len(text)


def sample_text(gen: Generator, tokenizer, prompt: str, n_samples: int, max_new: int,
                sampling: Sampling = Sampling(), seed: int = 0) -> list[str]:
    """`n_samples` continuations of `prompt` (its end is kept if it is too long), for the end-of-run samples of
    training: the same compiled decoding as `shardlm generate`."""
    [p], _ = encode_prompts(tokenizer, [prompt], gen.context, max_new, truncate=True)
    return [tokenizer.decode(c.ids) for c in gen.generate([p.ids] * n_samples, max_new, sampling, seed=seed)]
