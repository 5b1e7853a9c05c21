"""`shardlm explain`: the training state built exactly as `shardlm train` would build it for a config, and where
every parameter and optimizer-state leaf of it lives (`shardlm.explain`), with the notes a run header gives: the
sequence split's traffic, the pipeline's stages, the output head's schedule and which mesh axes cross hosts. Nothing is trained and nothing is written."""

from shardlm import distributed
from shardlm.config import Config, agree_on_config
from shardlm.explanation import Explanation
from shardlm.mesh import axes_across_hosts, check_tensor_inside_hosts, describe_hosts, mesh_from_config
from shardlm.train.data import tokenizer_vocab
from shardlm.train.source import model_source
from shardlm.train.state import abstract_train_state, check_shardable, create_train_state, split_notes


def explain_run(cfg: Config, log, devices=None) -> Explanation:
    """The explanation of `cfg`'s train state on its mesh; `log` takes the progress lines (data preparation).
    `devices`: abstract devices of a target (`shardlm.perf.targets`) to lay the state out on, shapes only,
    instead of building it on the local devices."""
    agree_on_config(cfg)
    mesh = mesh_from_config(cfg.mesh, devices)
    check_tensor_inside_hosts(mesh, log)
    vocab = tokenizer_vocab(cfg, log=log)
    check_shardable(cfg, mesh)
    state = (abstract_train_state(cfg, mesh, vocab)[2] if devices is not None
             else create_train_state(cfg, mesh, vocab).state)
    source = model_source(cfg)
    ex = source.explain(state, mesh)
    ex.notes.extend(split_notes(cfg, mesh))
    if head := source.head_note(mesh, vocab):
        ex.notes.append(head)
    if hosts := describe_hosts(mesh):
        ex.notes.append(f"{distributed.process_count()} processes on {hosts}")
        ex.axes_across_hosts = axes_across_hosts(mesh)
    return ex
