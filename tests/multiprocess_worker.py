"""One process of tests/integrations/test_multiprocess.py: mixed-precision training on a mesh
over processes.

Run by ``multiprocess_launcher.run_processes`` as ``worker COORDINATOR NUM_PROCESSES PROCESS_ID
MODE [CHECKPOINT_DIR]`` (each process of the pair), or directly as ``worker single`` on 4 local
devices: the same global batches in one process, the reference. Prints one JSON object, its last
line, with one entry per scenario.

The model is a small flax linen MLP, trained with ``jaxamp.autocast`` (float16, the cuda policy)
and ``jaxamp.dynamic_loss_scale(optax.adam(...))`` on a mesh "d" over every device of every
process. Each process holds its rows of the global batch (``make_array_from_process_local_data``):
rows 0-7 in process 0, rows 8-15 in process 1. Step ``OVERFLOW_STEP`` puts an inf in row
``BAD_ROW``, which only process 1 holds. MODE "train" runs the scenarios:

- ``fsdp``: ``jit`` with params and optimizer state sharded over all devices; it saves an orbax
  checkpoint of params and optimizer state after ``CHECKPOINT_AFTER`` steps (multi-process only),
  then writes the file ``SAVED`` next to it;
- ``data_parallel``: ``jit`` with params and optimizer state replicated, the batch sharded;
- ``shard_map``: the FSDP step under ``jax.shard_map``, the scaler with ``axis_name="d"``;
- ``train_step``: ``jaxamp.make_train_step`` on a linen ``TrainState``, data parallel;
- ``axis_name``: the scaler alone under ``shard_map`` on gradients whose inf lives in process 1's
  shard, with and without ``axis_name``;

MODE "restore" restores that checkpoint in a new pair of processes and runs the remaining steps.
"""

from __future__ import annotations

import json
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

GLOBAL_BATCH, FEATURES, CLASSES = 16, 8, 4
STEPS, OVERFLOW_STEP, BAD_ROW = 5, 1, 11
CHECKPOINT_AFTER = 3  # steps 0-2 run before the checkpoint, 3-4 after
SAVED = "saved"  # the file the training pair writes next to the checkpoint once it is complete
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2  # the scale backs off at step 1 and grows at step 3


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(nn.relu(nn.Dense(16)(x)))


model = MLP()


@jaxamp.autocast(device_type="cuda")
def loss_fn(params, x, y):
  logits = model.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_tx(axis_name=None):
  return jaxamp.dynamic_loss_scale(
    optax.adam(1e-2), init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, axis_name=axis_name
  )


def global_batches():
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((STEPS, GLOBAL_BATCH, FEATURES)).astype(np.float32)
  ys = rng.integers(0, CLASSES, (STEPS, GLOBAL_BATCH)).astype(np.int32)
  xs[OVERFLOW_STEP, BAD_ROW, 3] = np.inf
  return xs, ys


class World:
  """The mesh over every process's devices, and placing values on it."""

  def __init__(self):
    self.mesh = jax.make_mesh(
      (jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    self.replicated = NamedSharding(self.mesh, P())
    self.rows = NamedSharding(self.mesh, P("d"))
    per_process = GLOBAL_BATCH // jax.process_count()
    self.local = slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)

  def fsdp_spec(self, x) -> P:
    """Every leaf whose first axis splits over all devices is split; the rest is replicated."""
    shape = np.shape(x)
    return P("d") if shape and shape[0] % jax.device_count() == 0 else P()

  def specs(self, tree, fsdp: bool):
    return jax.tree.map(lambda x: self.fsdp_spec(x) if fsdp else P(), tree)

  def shardings(self, tree, fsdp: bool):
    return jax.tree.map(
      lambda x: NamedSharding(self.mesh, self.fsdp_spec(x) if fsdp else P()), tree
    )

  def put(self, tree, shardings):
    """Host values, the same in every process, as global arrays."""

    def put_leaf(x, sharding):
      x = np.asarray(x)
      return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put_leaf, tree, shardings)

  def batch(self, xs, ys, step):
    """Step ``step``'s global batch, each process giving its own rows."""
    return (
      jax.make_array_from_process_local_data(self.rows, xs[step][self.local]),
      jax.make_array_from_process_local_data(self.rows, ys[step][self.local]),
    )

  def gather(self, tree):
    """The global value of every leaf, as numpy arrays, in every process."""
    tree = jax.jit(lambda t: t, out_shardings=self.replicated)(tree)
    return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), tree)


def encode(tree):
  """Every leaf's dtype, shape and bytes (hex): JSON that keeps every bit."""
  return [[str(x.dtype), list(x.shape), x.tobytes().hex()] for x in jax.tree.leaves(tree)]


def local_copies(x):
  """This process's devices' copies of a replicated scalar, as Python values."""
  return [np.asarray(s.data).item() for s in x.addressable_shards]


def scaler_log(opt_state, loss):
  """Every local device's copy of the loss, scale and found_inf; the scaler's state_dict."""
  return {
    "loss": local_copies(loss),
    "scale": local_copies(opt_state.scale),
    "found_inf": local_copies(opt_state.found_inf),
    "state_dict": jaxamp.scaler.state_dict(opt_state),
  }


def scaled_update(loss_of, tx, params, opt_state):
  """One optimizer step on the gradients of the scaled ``loss_of(params)``."""

  def scaled_loss(params):
    loss = loss_of(params)
    return jaxamp.scale_loss(loss, opt_state), loss

  grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def make_step(tx, world, fsdp: bool, params, opt_state):
  def step(params, opt_state, x, y):
    return scaled_update(lambda params: loss_fn(params, x, y), tx, params, opt_state)

  param_sh, state_sh = world.shardings(params, fsdp), world.shardings(opt_state, fsdp)
  return jax.jit(
    step,
    in_shardings=(param_sh, state_sh, world.rows, world.rows),
    out_shardings=(param_sh, state_sh, world.replicated),
  )


def make_shard_map_step(tx, world, params, opt_state):
  """The FSDP step written per device: gather the weights, mean the loss over "d"."""
  gathered = jax.tree.map(lambda x: world.fsdp_spec(x) == P("d"), params)

  def step(params, opt_state, x, y):  # this device's shards of params, state and batch
    def global_loss(params):
      full = jax.tree.map(
        lambda q, g: jax.lax.all_gather(q, "d", tiled=True) if g else q, params, gathered
      )
      return jax.lax.pmean(loss_fn(full, x, y), "d")

    return scaled_update(global_loss, tx, params, opt_state)

  param_specs, state_specs = world.specs(params, True), world.specs(opt_state, True)
  return jax.jit(
    jax.shard_map(
      step,
      mesh=world.mesh,
      in_specs=(param_specs, state_specs, P("d"), P("d")),
      out_specs=(param_specs, state_specs, P()),
    )
  )


def train(world, step, params, opt_state, steps, xs, ys, on_step=None):
  """Runs ``steps``; the log of each step and the final params and state."""
  log = []
  for i in steps:
    before = world.gather(params)
    x, y = world.batch(xs, ys, i)
    params, opt_state, loss = step(params, opt_state, x, y)
    after = world.gather(params)
    entry = scaler_log(opt_state, loss)
    entry["params_unchanged"] = all(
      a.tobytes() == b.tobytes()
      for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )
    entry["local_rows_finite"] = bool(np.isfinite(xs[i][world.local]).all())
    log.append(entry)
    if on_step is not None:
      on_step(i, params, opt_state)
  return log, params, opt_state


def sharded_leaves(tree):
  """How many leaves are split over the devices (not fully replicated), of how many."""
  leaves = jax.tree.leaves(tree)
  return [sum(not x.sharding.is_fully_replicated for x in leaves), len(leaves)]


def init_params():
  return jax.tree.map(np.asarray, model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"])


def run_scaled(world, fsdp: bool, xs, ys, checkpoint_dir=None):
  tx = make_tx()
  host = init_params()
  params = world.put(host, world.shardings(host, fsdp))
  state_sh = world.shardings(jax.eval_shape(tx.init, host), fsdp)
  opt_state = jax.jit(tx.init, out_shardings=state_sh)(params)
  step = make_step(tx, world, fsdp, params, opt_state)
  saved = {}

  def on_step(i, params, opt_state):
    if checkpoint_dir is not None and i == CHECKPOINT_AFTER - 1:
      save(checkpoint_dir, params, opt_state)
      saved["state_dict"] = jaxamp.scaler.state_dict(opt_state)
      saved["opt_state"] = encode(world.gather(opt_state))

  log, params, opt_state = train(world, step, params, opt_state, range(STEPS), xs, ys, on_step)
  result = {
    "log": log,
    "params": encode(world.gather(params)),
    "opt_state": encode(world.gather(opt_state)),
    "sharded_params": sharded_leaves(params),
    "sharded_opt_state": sharded_leaves(opt_state),
  }
  if saved:
    result["at_checkpoint"] = saved
  return result


def run_shard_map(world, xs, ys):
  tx = make_tx(axis_name="d")
  host = init_params()
  params = world.put(host, world.shardings(host, True))
  opt_state = jax.jit(tx.init, out_shardings=world.shardings(jax.eval_shape(tx.init, host), True))(
    params
  )
  step = make_shard_map_step(tx, world, params, opt_state)
  log, params, opt_state = train(world, step, params, opt_state, range(STEPS), xs, ys)
  return {
    "log": log,
    "params": encode(world.gather(params)),
    "sharded_params": sharded_leaves(params),
  }


def run_train_step(world, xs, ys):
  tx = make_tx()

  def plain_loss(params, batch):  # make_train_step autocasts it
    logits = model.apply({"params": params}, batch[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

  state = TrainState.create(apply_fn=model.apply, params=init_params(), tx=tx)
  state = world.put(state, world.shardings(state, False))
  step = jax.jit(
    jaxamp.make_train_step(plain_loss, device_type="cuda"),
    in_shardings=(world.replicated, world.rows),
    out_shardings=world.replicated,
  )
  log = []
  for i in range(STEPS):
    before = world.gather(state.params)
    state, metrics = step(state, world.batch(xs, ys, i))
    after = world.gather(state.params)
    log.append(
      {
        "loss": local_copies(metrics["loss"]),
        "scale": local_copies(metrics["scale"]),
        "found_inf": local_copies(metrics["found_inf"]),
        "skipped_steps": local_copies(metrics["skipped_steps"]),
        "params_unchanged": encode(before) == encode(after),
      }
    )
  return {"log": log, "params": encode(world.gather(state.params))}


def run_axis_name(world):
  """The scaler alone under shard_map; the gradient's inf is in process 1's shard only."""
  n = jax.device_count()
  grads_host = np.ones((n, 3), np.float32)
  grads_host[n - 1, 1] = np.inf  # the last device's row: the last process's
  params = world.put(np.zeros((n, 3), np.float32), world.rows)
  grads = world.put(grads_host, world.rows)
  result = {}
  for name, axis_name, check_vma in [("with", "d", True), ("without", None, False)]:
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=INIT_SCALE, axis_name=axis_name)
    opt_state = jax.jit(tx.init, out_shardings=world.replicated)(params)
    specs = jax.tree.map(lambda _: P(), opt_state)

    def update(params, opt_state, grads, tx=tx):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    step = jax.jit(
      jax.shard_map(
        update,
        mesh=world.mesh,
        in_specs=(P("d"), specs, P("d")),
        out_specs=(P("d"), specs),
        check_vma=check_vma,
      )
    )
    _, opt_state = step(params, opt_state, grads)
    result[name] = {
      "found_inf": local_copies(opt_state.found_inf),
      "scale": local_copies(opt_state.scale),
    }
  # Without axis_name, check_vma (the default) rejects the replicated scale: it varies over "d".
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=INIT_SCALE)
  opt_state = jax.jit(tx.init, out_shardings=world.replicated)(params)
  specs = jax.tree.map(lambda _: P(), opt_state)
  try:
    jax.jit(
      jax.shard_map(
        lambda params, s, g: tx.update(g, s, params)[1],
        mesh=world.mesh,
        in_specs=(P("d"), specs, P("d")),
        out_specs=specs,
      )
    ).trace(params, opt_state, grads)
    result["without_check_vma_error"] = None
  except Exception as e:  # noqa: BLE001 - the message is what the test reads
    result["without_check_vma_error"] = f"{type(e).__name__}: {e}"[:500]
  return result


# --- checkpoints ---------------------------------------------------------------------------------


def save(directory, params, opt_state):
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(f"{directory}/fsdp", {"params": params, "opt_state": opt_state})
  if jax.process_index() == 0:  # all processes have saved: the restoring pair may start
    with open(f"{directory}/{SAVED}", "w") as f:
      f.write("saved\n")


def restore(world, directory, xs, ys):
  import orbax.checkpoint as ocp

  tx = make_tx()
  host = init_params()
  shapes = {"params": jax.eval_shape(lambda: host), "opt_state": jax.eval_shape(tx.init, host)}
  target = jax.tree.map(
    lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
    shapes,
    world.shardings(shapes, True),
  )
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(f"{directory}/fsdp", target)
  params, opt_state = restored["params"], restored["opt_state"]
  step = make_step(tx, world, True, params, opt_state)
  result = {
    "restored_opt_state": encode(world.gather(opt_state)),
    "state_dict": jaxamp.scaler.state_dict(opt_state),
    "sharded_params": sharded_leaves(params),
    "sharded_opt_state": sharded_leaves(opt_state),
  }
  log, final_params, final_state = train(
    world, step, params, opt_state, range(CHECKPOINT_AFTER, STEPS), xs, ys
  )
  result.update(
    log=log, params=encode(world.gather(final_params)), opt_state=encode(world.gather(final_state))
  )

  # load_state_dict puts torch's entries back into a scaler whose scale was overwritten.
  wrong = jaxamp.scaler.set_scale(opt_state, 1.0)
  loaded = jaxamp.scaler.load_state_dict(wrong, result["state_dict"])
  log, final_params, _ = train(world, step, params, loaded, range(CHECKPOINT_AFTER, STEPS), xs, ys)
  result["load_state_dict"] = {
    "wrong_scale": jaxamp.scaler.state_dict(wrong)["scale"],
    "state_dict": jaxamp.scaler.state_dict(loaded),
    "opt_state": encode(world.gather(loaded)),
    "scale_sharding_kept": loaded.scale.sharding == opt_state.scale.sharding,
    "log": log,
    "params": encode(world.gather(final_params)),
  }
  return result


def main(argv):
  if argv[0] == "single":
    mode, checkpoint_dir = "single", None
  else:
    coordinator, num_processes, process_id, mode, *rest = argv
    checkpoint_dir = rest[0] if rest else None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=int(num_processes),
      process_id=int(process_id),
    )
  world = World()
  xs, ys = global_batches()
  result = {
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "devices": jax.device_count(),
    "local_devices": jax.local_device_count(),
  }
  if mode == "restore":
    scenarios = {"restore": lambda: restore(world, checkpoint_dir, xs, ys)}
  else:
    scenarios = {
      "fsdp": lambda: run_scaled(world, True, xs, ys, checkpoint_dir),  # first: the checkpoint
      "data_parallel": lambda: run_scaled(world, False, xs, ys),
      "shard_map": lambda: run_shard_map(world, xs, ys),
      "train_step": lambda: run_train_step(world, xs, ys),
      "axis_name": lambda: run_axis_name(world),
    }
  result["seconds"] = {}
  for name, scenario in scenarios.items():
    begin = time.perf_counter()
    result[name] = scenario()
    result["seconds"][name] = round(time.perf_counter() - begin, 2)
  import multiprocess_launcher

  result["listening"] = multiprocess_launcher.listening_addresses()
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
