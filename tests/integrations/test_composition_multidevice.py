"""autocast composes with shard_map and with jit shardings on several (virtual CPU) devices."""

import textwrap

import cpu_devices

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxamp

    mesh = jax.make_mesh((4,), ("data",))
    x = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 16)) * 0.2

    def loss(w, x):
      return jnp.mean(jax.nn.log_softmax(jnp.tanh(x @ w) @ w) ** 2)

    data = NamedSharding(mesh, P("data"))
    x = jax.device_put(x, data)
    w = jax.device_put(w, NamedSharding(mesh, P()))

    # autocast inside shard_map: the same gradients as the float32 shard_map, in float32
    def data_parallel_grad(loss_fn):
      local = lambda w, x: jax.lax.pmean(jax.grad(loss_fn)(w, x), "data")
      return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    reference = data_parallel_grad(loss)(w, x)
    g = data_parallel_grad(jaxamp.autocast(loss, device_type="cuda"))(w, x)
    assert g.dtype == jnp.float32, g.dtype
    np.testing.assert_allclose(g, reference, rtol=0.1, atol=1e-2)

    # shard_map inside autocast
    def inner(w, x):
      return jax.lax.psum(jnp.sum(jnp.tanh(x @ w)), "data")
    mapped = jax.shard_map(inner, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    out = jax.jit(jaxamp.autocast(mapped, device_type="cuda"))(w, x)
    np.testing.assert_allclose(out, jnp.sum(jnp.tanh(x @ w)), rtol=2e-2)

    # jit with shardings: the output keeps its sharding and the low dtype
    f = jax.jit(jaxamp.autocast(lambda w, x: jnp.tanh(x @ w), device_type="cpu"),
                in_shardings=(NamedSharding(mesh, P()), data), out_shardings=data)
    y = f(w, x)
    assert y.dtype == jnp.bfloat16 and y.sharding == data, (y.dtype, y.sharding)
    print("OK")
""")


def test_autocast_composes_with_shard_map_and_jit_shardings_on_four_devices():
  result = cpu_devices.run_script(SCRIPT, devices=4)
  assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
