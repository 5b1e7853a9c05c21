"""The `shardlm` command line.

    shardlm train [--config FILE] [--run-dir DIR] [--cpu-devices N] [--overwrite] [--explain] [--no-progress]
                  [key=value ...]      (resumes the run in DIR if there is one)
    shardlm generate RUN_DIR|hf:DIR [--prompt TEXT | --prompts-file FILE] [--max-tokens N] [--temperature T] [--top-k K]
                     [--top-p P] [--seed S] [--num-samples M] [--json] [--truncate] [--no-cache] [--step N]
                     [--cpu-devices N] [mesh.*=value ...]
    shardlm explain [--config FILE] [--cpu-devices N] [--json] [key=value ...]
    shardlm plan [--devices N] [--config FILE] [--memory BYTES] [--json] [cost-model options] [key=value ...]
    shardlm bench --strategies LIST [--config FILE] [--cpu-devices N] [--steps N] [--json] [--plot FILE.png]
                  [key=value ...]
    shardlm profile [--config FILE] [--cpu-devices N] [--steps N] [--out DIR] [key=value ...]
    shardlm data prepare INPUT... --out DIR [--tokenizer T] [--val INPUT...] [--val-fraction F] [--force]
    shardlm tokenizer train INPUT... --vocab-size N --out PATH [--force]
    shardlm export RUN_DIR --out DIR [--step N] [--dtype bfloat16] [--max-shard-size BYTES] [--force]
    shardlm launch --processes N [--cpu-devices K] [--log-dir DIR] -- COMMAND [ARGS...]

Every command that runs a model also takes `--coordinator HOST:PORT --num-processes N --process-id I` (or their
environment variables, or a cluster JAX detects) to be one process of a multi-process run (`shardlm.distributed`).

The command line only parses and calls: every command is a function of the library (`train.loop.train`,
`train.explain.explain_run`, `perf.planner.plan`, `exporter.export`, ...), so what it does can be done from Python
too. JAX is imported only after the arguments are parsed, so `--cpu-devices` can still set the simulated device count.
Bad input (a `ShardlmError`) prints one line and exits with 2; set SHARDLM_DEBUG=1 to see its traceback. In a
multi-process run every process ends with that line, not only the one that found the problem.
"""

import argparse
import os
import sys

from shardlm import distributed
from shardlm.accelerator import cpu_unless_accelerator, gpu_xla_flags, start_cpu_quietly
from shardlm.distributed import add_options as add_distributed_options
from shardlm.errors import ShardlmError
from shardlm.units import parse_bytes, parse_duration

EXIT_USAGE = 2
VERBOSE_ENV = "SHARDLM_VERBOSE"  # `launch --verbose`, for the processes it starts


CPU_DEVICES_HELP = "simulate N devices on the CPU host (per process; sets XLA_FLAGS before JAX starts)"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config file (overrides apply on top)")
    p.add_argument("--cpu-devices", type=int, metavar="N", help=CPU_DEVICES_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. model=tiny train.steps=20 mesh.fsdp=-1")
    add_distributed_options(p)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="shardlm", description="Pretrain GPT-style models with JAX on any mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {name: add(sub) for name, add in (
        ("train", _train_parser), ("generate", _generate_parser), ("explain", _explain_parser),
        ("plan", _plan_parser), ("bench", _bench_parser), ("profile", _profile_parser), ("data", _data_parser),
        ("tokenizer", _tokenizer_parser), ("export", _export_parser), ("launch", _launch_parser))}
    # `data` and `tokenizer` are parsed by argparse's subcommands; the rest by `parse_args` below.
    return parser, {k: v for k, v in commands.items() if k not in ("data", "tokenizer")}


def _train_parser(sub) -> argparse.ArgumentParser:
    train = sub.add_parser("train", help="train a model (default: tiny GPT on the built-in Shakespeare corpus)")
    _common(train)
    train.add_argument("--run-dir", metavar="DIR", help="where the run's files go (default: runs/<name>)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run in --run-dir (by default a run there is resumed from its checkpoint)")
    train.add_argument("--explain", action="store_true", help="print every parameter's placement before training")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    train.add_argument("--compile-only", action="store_true",
                       help="do everything a run does up to the first step, compile the step, report its memory, "
                            "fit, collectives and estimated time, and exit (1 if it does not fit); writes nothing")
    _target_options(train)
    return train


TARGET_HELP = ("compile for this accelerator instead of the local devices, from any host (nothing runs): h100, h200, "
               "a100-80gb, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e (needs the `targets` extra)")


def _target_options(p: argparse.ArgumentParser, devices: bool = True) -> None:
    p.add_argument("--target", metavar="NAME", help=TARGET_HELP)
    if devices:
        p.add_argument("--devices", type=int, metavar="N", help="with --target: how many of its devices (default 1)")
        p.add_argument("--hosts", type=int, metavar="H", help="with --target: over how many hosts (default: full "
                                                              "hosts, 8 GPUs or 4 TPU chips each)")


def _generate_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="sample text from a trained run's newest checkpoint, or a Hugging Face "
                                          "model directory (KV-cache decoding)")
    gen.add_argument("run_dir", metavar="RUN_DIR", help="a training run's directory, or hf:DIR (a Hugging Face model "
                                                        "directory: config.json, *.safetensors, tokenizer files)")
    gen.add_argument("--prompt", default=None, help="text to continue (default: start a new document)")
    gen.add_argument("--prompts-file", metavar="FILE",
                     help="many prompts, decoded as batches: one per line, or .jsonl lines {\"prompt\": ...}")
    gen.add_argument("--max-tokens", type=int, default=100, metavar="N", help="new tokens per sample (default 100)")
    gen.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=40, metavar="K", help="sample from the K likeliest (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="sample from the likeliest tokens holding probability P (default 1 = all)")
    gen.add_argument("--seed", type=int, default=0, metavar="S")
    gen.add_argument("--num-samples", type=int, default=1, metavar="M", help="samples per prompt (default 1)")
    gen.add_argument("--batch-size", type=int, default=16, metavar="B", help="samples decoded together (default 16)")
    gen.add_argument("--json", action="store_true",
                     help="one JSON object per sample: prompt, text, new_tokens, tokens_per_s, stop")
    gen.add_argument("--truncate", action="store_true",
                     help="cut prompts too long for the context (and --max-tokens) to their last tokens")
    gen.add_argument("--no-cache", action="store_true",
                     help="re-run the whole context for every token (the naive decoder, for comparison)")
    gen.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint to load (default newest)")
    gen.add_argument("--cpu-devices", type=int, metavar="N", help=CPU_DEVICES_HELP)
    gen.add_argument("overrides", nargs="*", metavar="mesh.*=value",
                     help="the mesh to decode on, e.g. mesh.tensor=2 (default: the run's)")
    add_distributed_options(gen)
    return gen


def _explain_parser(sub) -> argparse.ArgumentParser:
    explain = sub.add_parser("explain", help="print every parameter's shape, partition spec and bytes per device")
    _common(explain)
    explain.add_argument("--json", action="store_true", help="the same as JSON, with per-device totals")
    _target_options(explain)
    return explain


def _plan_parser(sub) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="compile the train step for every data/fsdp/tensor split of N devices "
                                       "(and context splits for long sequences or small batches; nothing runs) "
                                       "and rank them by memory and estimated step time")
    plan.add_argument("--devices", type=int, metavar="N",
                      help="devices to plan for (simulated on the CPU host; default: the devices JAX sees)")
    plan.add_argument("--config", metavar="FILE", help="YAML config file (overrides apply on top)")
    plan.add_argument("--memory", metavar="BYTES", default=None,
                      help="memory per device, e.g. 80GB, 24GiB, 16e9 (default: the target's, or 80GB, an H100)")
    _target_options(plan, devices=False)
    plan.add_argument("--strategies", metavar="LIST",
                      help="only these strategies, comma-separated as plan names them (e.g. fsdp8,fsdp4+tp2)")
    plan.add_argument("--budget", metavar="TIME",
                      help="stop starting compiles after this long (e.g. 5m, 90s) and rank what compiled; the "
                           "rest are listed as not reached (run again: what compiled is read from --cache)")
    plan.add_argument("--cache", metavar="DIR",
                      help="keep each compiled step's reading here and read it back when a plan compiles the same "
                           "program again; 'none' turns it off (default: steps/ in shardlm's cache directory, "
                           "$SHARDLM_CACHE_DIR or ~/.cache/shardlm)")
    plan.add_argument("--remat", metavar="LIST",
                      help="compile each strategy under each of these remat policies (e.g. none,save_attention,full)"
                           " and name the cheapest that fits each; default: model.remat alone")
    plan.add_argument("--matmul-dtype", metavar="LIST",
                      help="compile each strategy with each of these matmul dtypes for the blocks (auto,fp8: FP8 "
                           "against bfloat16, on H100s) and say how they compare; default: model.matmul_dtype alone")
    plan.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                      help="peak FLOP/s per device for the cost model (default: H100 SXM dense for model.dtype, "
                           "494.5 float32 as TF32, 989 bfloat16)")
    plan.add_argument("--hosts", type=int, metavar="H",
                      help="the devices are split evenly over H hosts (nodes): say which collectives cross between "
                           "them and cost those at --inter-host-bandwidth (default: hosts of 8 devices)")
    plan.add_argument("--inter-host-bandwidth", metavar="RATE",
                      help="one host's network to the other hosts, one direction, e.g. 400Gb/s, 3.2Tb/s, 50GB/s "
                           "(default: 400 Gb/s per device of the host, as an H100 node's eight NICs)")
    plan.add_argument("--intra-node-gbs", type=float, default=450, metavar="GB/s",
                      help="link bandwidth per device within a host, one direction (default 450: NVLink 4)")
    plan.add_argument("--inter-node-gbs", type=float, default=None, metavar="GB/s",
                      help="the same as --inter-host-bandwidth, per device and in GB/s (default 50)")
    plan.add_argument("--devices-per-node", type=int, default=None, metavar="K",
                      help="the same as --hosts, as devices per host (default 8)")
    plan.add_argument("--latency-us", type=float, default=10, metavar="US", help="per collective (default 10)")
    plan.add_argument("--json", action="store_true",
                      help="a JSON list, one object per strategy, ranked; then those that failed to compile, were "
                      "pruned or are not possible, unranked, with why")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model=gpt2-small")
    return plan


def _bench_parser(sub) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help="run strategies on the local (or simulated) devices, interleaved: step "
                                         "time, tokens/s, TFLOP/s per device, MFU")
    _common(bench)
    bench.add_argument("--strategies", required=True, metavar="LIST",
                       help="comma-separated, as `shardlm plan` names them: e.g. dp8,fsdp8,tp4+dp2,fsdp4+tp2")
    bench.add_argument("--steps", type=int, default=10, metavar="N", help="timed steps per strategy (default 10)")
    bench.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps after compiling (default 2)")
    bench.add_argument("--json", action="store_true", help="the results as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="also draw a bar chart of tokens/s and MFU")
    return bench


def _profile_parser(sub) -> argparse.ArgumentParser:
    prof = sub.add_parser("profile", help="capture a jax.profiler trace of a few train steps after warm-up, with "
                                          "named scopes per layer and per step")
    _common(prof)
    prof.add_argument("--steps", type=int, default=3, metavar="N", help="steps to trace (default 3)")
    prof.add_argument("--warmup", type=int, default=2, metavar="N", help="untraced steps first (default 2)")
    prof.add_argument("--out", metavar="DIR", help="where the trace goes (default runs/profile-<name or preset>)")
    return prof


def _data_parser(sub) -> argparse.ArgumentParser:
    data = sub.add_parser("data", help="prepare token files for training")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare", help="tokenize text once into DIR/train.bin, DIR/val.bin and DIR/meta.json",
        description="Inputs: .txt files (documents separated by <|endoftext|>, as in TinyStories), .jsonl, "
                    ".parquet, or folders of them.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT")
    prep.add_argument("--tokenizer", default="bpe", metavar="T",
                      help="bpe (the default, as `shardlm train` for text: a byte-level BPE of --vocab-size tokens "
                           "trained on the inputs), gpt2 (tiktoken), bytes, or bpe:PATH (from `shardlm tokenizer "
                           "train`)")
    prep.add_argument("--out", required=True, metavar="DIR")
    prep.add_argument("--val", nargs="+", default=[], metavar="INPUT",
                      help="validation inputs (default: the last --val-fraction of the tokens)")
    prep.add_argument("--val-fraction", type=float, default=None, metavar="F",
                      help="without --val: the last F of the tokens is the validation split (default 0.05)")
    prep.add_argument("--vocab-size", type=int, default=2048, metavar="N",
                      help="for --tokenizer bpe (default 2048, as data.tokenizer_vocab)")
    _reading_options(prep)
    prep.add_argument("--force", action="store_true", help="replace DIR if it holds other prepared data")
    prep.add_argument("--no-progress", action="store_true")
    inspect = data_sub.add_parser(
        "inspect", help="a run's data sources: tokens, weights, their shares of the first batches and the epochs "
                        "each will see in train.steps")
    inspect.add_argument("--config", metavar="FILE", help="YAML config file (overrides apply on top)")
    inspect.add_argument("--batches", type=int, default=100, metavar="N",
                         help="the first N global batches to count each source's share in (default 100)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.sources=[...]")
    return data


def _tokenizer_parser(sub) -> argparse.ArgumentParser:
    tok = sub.add_parser("tokenizer", help="train a tokenizer")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser("train", help="train a byte-level BPE with Hugging Face tokenizers")
    tok_train.add_argument("inputs", nargs="+", metavar="INPUT")
    tok_train.add_argument("--vocab-size", type=int, required=True, metavar="N")
    tok_train.add_argument("--out", required=True, metavar="PATH", help="the tokenizer.json to write")
    tok_train.add_argument("--max-bytes", type=float, default=None, metavar="B",
                           help="train on at most this much text (default: all of it)")
    _reading_options(tok_train)
    tok_train.add_argument("--force", action="store_true", help="replace PATH if it exists")
    return tok


def _export_parser(sub) -> argparse.ArgumentParser:
    export = sub.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face model directory (config, safetensors, tokenizer)",
        description="Writes config.json, model.safetensors (sharded with an index above --max-shard-size), "
                    "generation_config.json and the tokenizer, so that transformers' AutoTokenizer and "
                    "AutoModelForCausalLM load DIR. Atomic: a failed export leaves DIR as it was.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a training run's directory")
    export.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face model directory to write")
    export.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint (default newest)")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' dtype in the files (default float32)")
    export.add_argument("--max-shard-size", default="5GB", metavar="BYTES",
                        help="start a new safetensors file above this size (default 5GB, as transformers)")
    export.add_argument("--force", action="store_true", help="replace DIR if it is not empty")
    export.add_argument("--cpu-devices", type=int, metavar="N", help=CPU_DEVICES_HELP)
    add_distributed_options(export)
    return export


def _launch_parser(sub) -> argparse.ArgumentParser:
    launch = sub.add_parser(
        "launch", help="run N processes of a command on this host as one multi-process run (like torchrun)",
        usage="shardlm launch --processes N [--cpu-devices K] [options] -- COMMAND [ARGS...]",
        description="Starts N processes of `shardlm COMMAND ARGS...` joined into one run: process 0 writes to this "
                    "terminal, the others to log files. Ctrl-C and SIGTERM are passed on to every process; when "
                    "one fails, the others are stopped and the launcher exits non-zero, naming it.")
    launch.add_argument("--processes", type=int, required=True, metavar="N", help="how many processes")
    launch.add_argument("--cpu-devices", type=int, metavar="K",
                        help="simulate K CPU devices per process (each process then stands for a host)")
    launch.add_argument("--devices-per-process", type=int, default=1, metavar="D",
                        help="accelerators per process on a GPU host (default 1: one process per GPU)")
    launch.add_argument("--log-dir", metavar="DIR",
                        help="where processes 1..N-1 write their output (default runs/launch-<date>-<time>)")
    launch.add_argument("--heartbeat-timeout", type=int, metavar="S",
                        help="the processes stop S seconds after one stops responding (default 30)")
    launch.add_argument("--port", type=int, metavar="P", help="the coordinator's port (default: a free one)")
    launch.add_argument("--verbose", action="store_true",
                        help="also show the collective library's own lines (gloo's, one per communicator)")
    return launch


def _reading_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-field", default="text", metavar="NAME", help="JSONL field / Parquet column (default text)")
    p.add_argument("--invalid-utf8", choices=("error", "replace"), default="error",
                   help="error (default): stop at the first bad byte, naming its offset; replace: U+FFFD, counted")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options may stand anywhere among the key=value overrides (`train a=1 --run-dir x b=2`)."""
    parser, commands = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in commands:
        return parser.parse_args(argv)  # help, or argparse's own error for an unknown command
    if argv[0] == "launch":  # the launcher's options, then `--` and the command it runs, untouched
        cut = argv.index("--") if "--" in argv else len(argv)
        args = commands["launch"].parse_args(argv[1:cut])
        args.command, args.launched = "launch", argv[cut + 1:]
        return args
    args = commands[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def _data(args: argparse.Namespace) -> None:
    if args.data_command == "inspect":
        _data_inspect(args)
    else:
        _data_prepare(args)


def _data_inspect(args: argparse.Namespace) -> None:
    import json

    from shardlm.config import load_config
    from shardlm.train.data import format_inspection, inspect_sources

    if args.batches < 1:
        raise ShardlmError(f"--batches must be at least 1, got {args.batches}")
    if cpu_unless_accelerator():  # reading data imports JAX: its start-up quiet, as for the model commands
        start_cpu_quietly()
    report = inspect_sources(load_config(args.config, args.overrides), args.batches, log=_to_stderr)
    print(json.dumps(report, indent=2) if args.json else format_inspection(report))


def _data_prepare(args: argparse.Namespace) -> None:
    from shardlm.data.prepare import prepare

    if args.val and args.val_fraction is not None:
        raise ShardlmError("--val and --val-fraction both choose the validation split; pass one of them")
    data = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size, val_inputs=args.val,
                   val_fraction=0.05 if args.val_fraction is None else args.val_fraction, text_field=args.text_field,
                   invalid_utf8=args.invalid_utf8, force=args.force, progress=not args.no_progress)
    meta = data.meta
    print(f"{data.path}: {meta['num_documents']:,} documents, "
          + ", ".join(f"{s} {meta['splits'][s]['num_tokens']:,} tokens" for s in ("train", "val"))
          + f" ({meta['dtype']}); train with: shardlm train data.path={data.path}")


def _tokenizer_train(args: argparse.Namespace) -> None:
    from pathlib import Path

    from shardlm.data.prepare import save_tokenizer_file, train_tokenizer

    out = Path(args.out)
    if out.is_dir():
        raise ShardlmError(f"--out {out} is a directory; pass a file path such as {out / 'tokenizer.json'}")
    if out.exists() and not args.force:
        raise ShardlmError(f"--out {out} exists; pass --force to replace it, or choose another path")
    tok = train_tokenizer(args.inputs, args.vocab_size, max_bytes=args.max_bytes, text_field=args.text_field,
                          invalid_utf8=args.invalid_utf8, show_progress=True)
    save_tokenizer_file(tok, out)
    print(f"{out}: {tok.vocab_size}-token byte-level BPE; use it with --tokenizer bpe:{out}")


def _generate(args: argparse.Namespace) -> None:
    import json
    import time

    from shardlm.generate import IncrementalText, encode_prompts, read_prompts_file
    from shardlm.load import load_model
    from shardlm.mesh import describe_mesh
    from shardlm.sampling import Sampling

    if args.max_tokens < 1 or args.num_samples < 1 or args.batch_size < 1:
        raise ShardlmError("--max-tokens, --num-samples and --batch-size must be >= 1")
    if not 0 <= args.seed < 2**32:
        raise ShardlmError(f"--seed {args.seed} is out of range; pass 0 to {2**32 - 1}")
    if args.prompt is not None and args.prompts_file:
        raise ShardlmError("--prompt and --prompts-file both give prompts; pass one of them")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)  # checks its ranges
    texts = read_prompts_file(args.prompts_file) if args.prompts_file else [args.prompt or ""]
    m = load_model(args.run_dir, step=args.step, overrides=args.overrides, require_tokenizer=True)
    prompts, notes = encode_prompts(m.tokenizer, texts, m.cfg.model.seq_len, args.max_tokens, args.truncate)
    for note in [m.note] * bool(m.note) + notes:
        print(f"note: {note}", file=sys.stderr)
    gen = m.generator(use_cache=not args.no_cache, max_batch=args.batch_size)
    rows = [i for i in range(len(prompts)) for _ in range(args.num_samples)]  # sample -> its prompt
    stream = None
    if len(rows) == 1 and not args.json:  # one sample: print tokens as they come
        print(prompts[0].shown(m.tokenizer), end="", flush=True)
        stream = IncrementalText(m.tokenizer, lambda piece: print(piece, end="", flush=True))
    t0, compile_before = time.perf_counter(), gen.compile_s
    done = gen.generate([prompts[i].ids for i in rows], args.max_tokens, sampling, seed=args.seed,
                        on_token=stream and (lambda _, token: stream.add(token)))
    seconds = time.perf_counter() - t0 - (gen.compile_s - compile_before)  # all batches, compiles excluded
    if stream:
        stream.flush()
        print()
    for i, c in enumerate(done):
        text = m.tokenizer.decode(c.ids)
        if args.json:
            print(json.dumps({"prompt": texts[rows[i]], "text": text, "new_tokens": len(c.ids),
                              "tokens_per_s": round(c.tokens_per_s, 2), "stop": c.stop,
                              "prompt_tokens": len(c.prompt_ids)}, ensure_ascii=False))
        elif not stream:
            print(f"=== sample {i + 1} of {len(done)} (prompt {rows[i] + 1}) ===\n{prompts[rows[i]].shown(m.tokenizer)}"
                  f"{text}")
    total = sum(len(c.ids) for c in done)
    cache = (f"KV cache of {gen.cache_bytes_per_token:,} B per token ({gen.cache_kind} per layer)"
             if gen.use_cache and gen.cache_bytes_per_token else "no cache")
    print(f"{total} tokens in {seconds:.2f} s ({total / max(seconds, 1e-9):.1f} tokens/s, {cache}, mesh "
          f"{describe_mesh(m.mesh)}; compiling took {gen.compile_s:.1f} s)", file=sys.stderr)


def _plan(args: argparse.Namespace) -> None:
    import json

    import jax

    from shardlm.perf.costmodel import hardware_for
    from shardlm.perf.planner import format_plan, plan, plan_peak_dtype, report_progress
    from shardlm.perf.step_cache import caching_steps, default_directory
    from shardlm.perf.strategies import parse_strategies

    budget = parse_duration(args.budget) if args.budget else None  # before anything slow: a typo fails at once
    target = _target(args)
    n = args.devices or (1 if target else jax.device_count())
    cfg = _load_for(target, args)
    memory = parse_bytes(args.memory) if args.memory else None
    matmul_dtypes = [m.strip() for m in args.matmul_dtype.split(",") if m.strip()] if args.matmul_dtype else None
    dtype = plan_peak_dtype(cfg, matmul_dtypes)
    if target:
        hw = target.hardware(dtype, n, args.hosts, memory, args.inter_host_bandwidth)
    else:
        hw = hardware_for(n, dtype, memory_bytes=memory or 80e9, peak_tflops=args.peak_tflops,
                          intra_node_gbs=args.intra_node_gbs, hosts=args.hosts,
                          devices_per_node=args.devices_per_node, inter_host_bandwidth=args.inter_host_bandwidth,
                          inter_node_gbs=args.inter_node_gbs, latency_us=args.latency_us)
    if any(o.split("=", 1)[0].strip().startswith("mesh.") for o in args.overrides):
        print("note: plan tries every mesh (or --strategies); the mesh.* overrides are ignored", file=sys.stderr)
    strategies = parse_strategies(args.strategies, n) if args.strategies is not None else None
    remats = [r.strip() for r in args.remat.split(",") if r.strip()] if args.remat else None
    cache = None if args.cache == "none" else (args.cache or default_directory())
    with caching_steps(cache) as steps:
        p = plan(cfg, n if target else args.devices, hw, strategies=strategies, log=report_progress, target=target,
                 hosts=args.hosts, remats=remats, matmul_dtypes=matmul_dtypes, budget_s=budget)
    if steps is not None and steps.unwritable:
        report_progress(f"note: the step cache {cache} could not be written ({steps.unwritable}): this plan's "
                        "compiles are not kept; choose a writable --cache DIR, or --cache none")
    print(json.dumps(p.to_list(), indent=2) if args.json else format_plan(p))
    unreached, cached = p.unreached, sum(r.cached for r in p.strategies)
    report_progress(f"planned {len(p.strategies)} strategies in {p.wall_s:.1f} s"
                    + (f", {cached} of them read from the step cache ({cache})" if cached else "")
                    + (f" ({len(p.pruned) - unreached} more pruned: they cannot win)" if len(p.pruned) > unreached
                       else "") + (f" ({unreached} not reached within --budget {args.budget})" if unreached else ""))


def _bench(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    import jax

    from shardlm.config import agree_on_config, load_config
    from shardlm.perf.bench import bench, format_bench, plot_bench
    from shardlm.perf.strategies import parse_strategies

    if args.steps < 1 or args.warmup < 0:
        raise ShardlmError("--steps must be >= 1 and --warmup >= 0")
    if args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")):
        raise ShardlmError(f"--plot {args.plot}: name a .png (or .svg, .pdf) file")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise ShardlmError(f"--plot {args.plot}: the directory {Path(args.plot).parent} does not exist")
    cfg = load_config(args.config, args.overrides)
    agree_on_config(cfg)
    strategies = parse_strategies(args.strategies, jax.device_count())
    result = bench(cfg, strategies, steps=args.steps, warmup=args.warmup, log=_to_stderr)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_bench(result, cfg))
    if args.plot and distributed.is_primary():
        plot_bench(result, cfg, args.plot)
        print(f"chart written to {args.plot}", file=sys.stderr)


def _profile(args: argparse.Namespace) -> None:
    from pathlib import Path

    from shardlm.config import agree_on_config, load_config, model_label
    from shardlm.perf.profile import format_profile, profile

    if args.steps < 1 or args.warmup < 0:
        raise ShardlmError("--steps must be >= 1 and --warmup >= 0")
    cfg = load_config(args.config, args.overrides)
    agree_on_config(cfg)
    # Traces accumulate under DIR/plugins/profile/<time>/, which TensorBoard and XProf list as separate runs.
    out = Path(args.out) if args.out else Path("runs") / f"profile-{cfg.name or model_label(cfg.model)}"
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"--out {out} is a file; pass a directory")
    print(format_profile(profile(cfg, out, steps=args.steps, warmup=args.warmup, log=_to_stderr)))


def _export(args: argparse.Namespace) -> None:
    from shardlm.exporter import export

    if args.step is not None and args.step < 0:
        raise ShardlmError(f"--step must be >= 0, got {args.step}")
    export(args.run_dir, args.out, step=args.step, dtype=args.dtype,
           max_shard_bytes=parse_bytes(args.max_shard_size, "--max-shard-size"), force=args.force, log=_to_stderr)


def _target(args: argparse.Namespace):
    """The `--target` of a command (checked: known, and its compiler installed), or None."""
    if getattr(args, "target", None) is None:
        for flag in ("devices", "hosts"):
            if getattr(args, flag, None) is not None and args.command != "plan":
                raise ShardlmError(f"--{flag} counts a target's devices; pass --target too (e.g. --target h100), "
                                   "or --cpu-devices to simulate local ones")
        return None
    from shardlm.perf import targets

    target = targets.get(args.target)
    targets.check_installed(target)
    return target


def _load_for(target, args: argparse.Namespace):
    """The command's config, with model.dtype=auto resolved for the target (or the local devices)."""
    import contextlib

    from shardlm.accelerator import compiling_for
    from shardlm.config import load_config

    with compiling_for(target.accelerator) if target else contextlib.nullcontext():
        return load_config(args.config, args.overrides)


def _compile_only(args: argparse.Namespace) -> int:
    from shardlm.perf.compile_only import compile_train_step, format_report

    target = _target(args)
    cfg = _decided(_load_for(target, args), target=target, n_devices=args.devices, hosts=args.hosts)
    report = compile_train_step(cfg, target=target, n_devices=args.devices, hosts=args.hosts, log=_to_stderr)
    print(format_report(report))
    return 0 if report.fits else 1


def _train(args: argparse.Namespace) -> int | None:
    from shardlm.train.loop import train
    from shardlm.train.rundir import run_config

    if args.compile_only:
        return _compile_only(args)
    if args.target:
        raise ShardlmError(f"--target {args.target} compiles for devices this host does not have; add "
                           "--compile-only to compile the step and report, or use shardlm plan --target")

    _target(args)  # --devices or --hosts without a target
    cfg, run_dir = run_config(args.config, args.overrides, args.run_dir, args.overwrite)
    train(_decided(cfg), run_dir, overwrite=args.overwrite, progress=not args.no_progress, explain=args.explain)


def _decided(cfg, **where):
    """`cfg` with mesh=auto and model.remat=auto resolved by the planner (`shardlm.perf.auto`), saying what it
    chose and why."""
    from shardlm.perf.auto import decide, wants_plan

    if not wants_plan(cfg):
        return cfg
    decision = decide(cfg, log=_to_stderr, **where)
    print(decision.text, flush=True)
    return decision.cfg


def _explain(args: argparse.Namespace) -> None:
    import json

    from shardlm.train.explain import explain_run

    target = _target(args)
    cfg = _load_for(target, args)
    if target is None:
        ex = explain_run(cfg, log=_to_stderr)  # stdout is the table (or JSON)
        print(ex.to_json() if args.json else ex)
        return
    from shardlm.perf import targets
    from shardlm.perf.compile_only import compile_train_step, format_report

    ex = explain_run(cfg, log=_to_stderr, devices=list(targets.topology(target, args.devices or 1, args.hosts).devices))
    report = compile_train_step(cfg, target=target, n_devices=args.devices, hosts=args.hosts, log=_to_stderr)
    if args.json:
        print(json.dumps(ex.to_dict() | {"compiled": report.to_dict()}, indent=2))
    else:
        print(f"{ex}\n\n{format_report(report)}")


def _launch(args: argparse.Namespace) -> int:
    from shardlm.launch import launch

    if args.launched and args.launched[0] in ("-h", "--help"):
        raise ShardlmError("name the command to launch after --, e.g. shardlm launch --processes 2 -- train")
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # the processes inherit it
    return launch(args.processes, args.launched, cpu_devices=args.cpu_devices,
                  devices_per_process=args.devices_per_process, log_dir=args.log_dir,
                  heartbeat_timeout=args.heartbeat_timeout, port=args.port)


def _join(args: argparse.Namespace) -> None:
    """Join a multi-process run if this is one; then only process 0 prints a command's result (train logs on
    every process: the launcher keeps the others' output in log files)."""
    if not distributed.join(distributed.JoinOptions.from_args(args), log=_to_stderr):
        return
    # gloo prints a line to the C++ stdout for every communicator it opens; stdout is the command's result (the
    # JSON of `bench --json`, the text of `generate`), so native writes to fd 1 are dropped from here on (go to
    # stderr with `launch --verbose`: nothing else in the process writes natively to fd 1).
    sys.stdout.flush()
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    result = os.dup(1)
    if os.environ.get(VERBOSE_ENV):
        os.dup2(2, 1)
    else:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    sys.stdout = os.fdopen(result, "w", buffering=1, encoding=encoding, errors=errors)
    if args.command != "train":
        # Outside training (which stops every process together at a step, see `train.preemption`), SIGTERM ends
        # the command on every process at once, like Ctrl-C; JAX's preemption notifier would otherwise absorb it.
        import signal

        def abort(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, abort)
    own = {"process_id", "heartbeat_timeout", "connect_timeout"}  # may differ between processes
    distributed.agree("command", {k: v for k, v in sorted(vars(args).items()) if k not in own},
                      "the command line", "start every process with the same command")
    if args.command != "train" and not distributed.is_primary():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process


def _simulate_devices(args: argparse.Namespace) -> None:
    """`--cpu-devices N` (`plan --devices N`: N devices to compile for, with the planning flags), before JAX starts."""
    from shardlm.mesh import simulate_cpu_devices

    if getattr(args, "devices", None) is not None and args.devices < 1:  # (with --target too: not taken as 1)
        raise ShardlmError(f"--devices must be at least 1, got {args.devices}")
    if args.command == "plan" and args.target:
        return  # a target's devices are abstract: nothing to simulate
    if args.command == "plan":
        if args.devices is not None:
            from shardlm.perf.planner import planning_flags

            simulate_cpu_devices(args.devices)
            planning_flags()
    elif args.cpu_devices is not None:
        simulate_cpu_devices(args.cpu_devices)


# Commands that run no model: no devices to simulate, no run of several processes to join.
LOCAL_COMMANDS = {"launch": _launch, "data": _data, "tokenizer": _tokenizer_train}
MODEL_COMMANDS = {"train": _train, "generate": _generate, "explain": _explain, "plan": _plan, "bench": _bench,
                  "profile": _profile, "export": _export}


def _run(args: argparse.Namespace) -> int | None:
    if args.command in LOCAL_COMMANDS:
        return LOCAL_COMMANDS[args.command](args)
    cpu_only = cpu_unless_accelerator()
    if not cpu_only:
        gpu_xla_flags()
    _simulate_devices(args)
    if args.command != "plan":  # a plan compiles on this process's (simulated) devices only
        _join(args)
    if cpu_only:
        start_cpu_quietly()
    return MODEL_COMMANDS[args.command](args)


def _to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        code = _run(args) or 0
    except ShardlmError as e:
        if os.environ.get("SHARDLM_DEBUG"):
            print(f"shardlm: error: {e}", file=sys.stderr, flush=True)
            distributed.fail(str(e), EXIT_USAGE, raising=True)  # tells the others; never returns if it does
            raise
        # In a run of several processes the others stop too, with this line; then this never returns.
        distributed.fail(str(e), EXIT_USAGE)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C outside the training loop, or a second Ctrl-C / SIGTERM inside it
        print("shardlm: aborted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        distributed.fail("aborted by a signal", 130, raising=True)
        # At once: a checkpoint write still in flight (Orbax's non-daemon thread) is abandoned, not waited for;
        # it stays incomplete and the next start ignores it.
        os._exit(130)
    except BaseException as e:  # a bug: its traceback, and the other processes told rather than left waiting
        if distributed.is_multiprocess() and not isinstance(e, SystemExit):
            import traceback

            traceback.print_exc()
            distributed.fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (its traceback is "
                             f"in process {distributed.process_index()}'s output)", 1, raising=True)
        raise
    distributed.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
