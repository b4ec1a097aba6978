"""Bad input to the autocast API (``autocast``, ``explain``, ``is_autocast_available``,
``get_autocast_dtype``, ``custom_fwd``/``custom_bwd``, ``register_op``, ``autocast_disabled``):
a clear ValueError/TypeError naming the valid choices (and the JAX spelling where a torch user
would try something else first), or, for unusual but meaningful input, what a demanding user
expects.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._src.policies import policy

DEVICES = ("cpu", "cuda", "xpu")
VALID_DEVICES = re.escape(str(policy.device_types()))  # ('cpu', 'cuda', ...): every table


def identity(x):
  return x


def matmul(x):
  return x @ x.T


# --- device_type ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device_type", ["GPU", "CUDA", "cuda:x", "cuda:", "mps:0", "metal", ""])
def test_autocast_unknown_device_type_is_a_value_error_naming_the_choices(device_type):
  with pytest.raises(ValueError, match=rf"`device_type` must be one of {VALID_DEVICES}"):
    jaxamp.autocast(identity, device_type=device_type)


@pytest.mark.parametrize("device_type", [3, jax.devices()[0], ["cuda"]])
def test_autocast_non_string_device_type_is_a_type_error_naming_the_choices(device_type):
  with pytest.raises(TypeError, match=rf"`device_type` must be a string, one of {VALID_DEVICES}"):
    jaxamp.autocast(identity, device_type=device_type)


def test_autocast_checks_the_device_type_even_when_disabled():
  with pytest.raises(ValueError, match="`device_type` must be one of"):
    jaxamp.autocast(identity, device_type="mps", enabled=False)


@pytest.mark.parametrize("device_type", ["gpu", "rocm", "cuda"])
def test_jax_gpu_platform_names_are_the_cuda_policy(device_type):
  assert jaxamp.is_autocast_available(device_type)
  assert jaxamp.get_autocast_dtype(device_type) == jnp.float16
  fun = jaxamp.autocast(lambda x: x @ x, device_type=device_type)
  assert fun(jnp.ones((2, 2))).dtype == jnp.float16
  assert jaxamp.explain(lambda x: x @ x, device_type=device_type)(jnp.ones((2, 2)))


@pytest.mark.parametrize(
  "device_type, base", [("cuda:0", "cuda"), ("cpu:0", "cpu"), ("gpu:1", "cuda")]
)
def test_torchs_indexed_device_string_is_its_device_types_policy(device_type, base):
  # torch.autocast("cuda:0"), torch.amp.is_autocast_available("cuda:1"): a policy is per type.
  assert jaxamp.is_autocast_available(device_type)
  assert jaxamp.get_autocast_dtype(device_type) == jaxamp.get_autocast_dtype(base)
  assert jaxamp.policy(device_type) == jaxamp.policy(base)
  x = jnp.ones((2, 2))
  assert jaxamp.autocast(matmul, device_type)(x).dtype == jaxamp.get_autocast_dtype(base)


def test_an_unknown_device_type_error_says_which_platform_maps_to_which_policy():
  with pytest.raises(ValueError) as error:
    jaxamp.autocast(lambda x: x, device_type="metal")
  message = str(error.value)
  assert 'gpu, rocm -> "cuda"' in message and 'cpu -> "cpu"' in message
  assert "got 'metal'" in message


@pytest.mark.parametrize(
  "backend, device_type",
  [("gpu", "cuda"), ("cuda", "cuda"), ("rocm", "cuda"), ("cpu", "cpu"), ("metal", "cpu")],
)
def test_the_default_device_type_maps_jaxs_backend(monkeypatch, backend, device_type):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  assert policy.default_device_type() == device_type


def test_a_registered_table_is_its_own_platforms_policy(monkeypatch):
  table = policy.get_table("cpu")
  monkeypatch.setitem(policy._TABLES, "npu", table)
  assert jaxamp.is_autocast_available("npu") and policy.get_table("npu") is table
  assert 'npu -> "npu"' in policy._platforms()


# --- dtype ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "dtype",
  [
    jnp.float32,
    jnp.float64,
    jnp.int8,
    jnp.int32,
    jnp.float8_e5m2,
    "float8",
    "half?",
    3,
    object(),
  ],
)
def test_autocast_unsupported_dtype_is_a_value_error_naming_the_valid_ones(dtype):
  valid = "`dtype` must be one of jnp.float16, jnp.bfloat16 or jnp.float8_e4m3fn"
  with pytest.raises(ValueError, match=valid):
    jaxamp.autocast(identity, device_type="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", np.float16, jnp.dtype("bfloat16"), "bfloat16"])
def test_autocast_accepts_any_spelling_of_a_low_dtype(dtype):
  out = jaxamp.autocast(matmul, device_type="cuda", dtype=dtype)(jnp.ones((2, 2)))
  assert out.dtype == jnp.dtype(dtype)


# --- the function, the flags and the spellings ----------------------------------------------------


@pytest.mark.parametrize("fun", [3, jnp.ones(2)])
def test_autocast_of_a_non_callable_is_a_type_error(fun):
  with pytest.raises(TypeError, match="autocast transforms a callable"):
    jaxamp.autocast(fun, device_type="cuda")


@pytest.mark.parametrize("fun", [3, "cuda", jnp.ones(2)])
def test_autocast_decorator_of_a_non_callable_is_a_type_error(fun):
  with pytest.raises(TypeError, match="autocast transforms a callable"):
    jaxamp.autocast(device_type="cuda")(fun)


@pytest.mark.parametrize(
  "name, value",
  [("enabled", 1), ("enabled", "yes"), ("enabled", np.True_), ("cache_enabled", "no")],
)
def test_autocast_non_bool_flags_are_type_errors_naming_the_flag(name, value):
  with pytest.raises(TypeError, match=f"`{name}` must be a bool"):
    jaxamp.autocast(identity, device_type="cuda", **{name: value})


def test_autocast_without_a_function_is_a_decorator():
  @jaxamp.autocast(device_type="cuda")
  def matmul(x):
    return x @ x

  assert matmul(jnp.ones((2, 2))).dtype == jnp.float16


def test_autocast_decorator_form_validates_its_arguments_before_decorating():
  with pytest.raises(ValueError, match="`dtype` must be one of"):
    jaxamp.autocast(device_type="cuda", dtype=jnp.int8)


@pytest.mark.parametrize("device_type", ["cuda", None])
def test_autocast_as_a_context_manager_is_a_type_error_showing_both_spellings(device_type):
  with pytest.raises(TypeError) as error:
    with jaxamp.autocast(device_type=device_type):
      pass
  message = str(error.value)
  assert "function transformation" in message
  assert 'jaxamp.autocast(f, device_type="cuda")' in message
  assert '@jaxamp.autocast(device_type="cuda")' in message
  assert "jaxamp.autocast_disabled()" in message


def test_autocast_device_type_may_be_the_second_positional_argument():
  x = jnp.ones((2, 2))
  out = jaxamp.autocast(matmul, "cuda")(x)
  assert out.dtype == jnp.float16
  assert out.tobytes() == jaxamp.autocast(matmul, device_type="cuda")(x).tobytes()


def test_autocast_options_after_the_device_type_are_keyword_only():
  with pytest.raises(TypeError, match="positional argument"):
    jaxamp.autocast(identity, "cuda", jnp.bfloat16)


def test_torch_spelling_with_the_device_type_first_is_a_decorator():
  @jaxamp.autocast("cuda")
  def matmul(x):
    return x @ x

  assert matmul(jnp.ones((2, 2))).dtype == jnp.float16


def test_torch_spelling_equals_the_keyword_spelling_bit_for_bit():
  x = jax.random.normal(jax.random.key(0), (8, 8))
  f = lambda x: jnp.tanh(x @ x.T).sum(-1)  # noqa: E731
  torch_style = jaxamp.autocast("cuda")(f)(x)
  keyword = jaxamp.autocast(f, device_type="cuda")(x)
  assert torch_style.dtype == keyword.dtype and torch_style.tobytes() == keyword.tobytes()


def test_torch_spelling_decorator_takes_a_dtype():
  @jaxamp.autocast("cuda", dtype=jnp.bfloat16)
  def matmul(x):
    return x @ x

  assert matmul(jnp.ones((2, 2))).dtype == jnp.bfloat16


def test_torch_spelling_with_an_agreeing_device_type_keyword_is_accepted():
  assert jaxamp.autocast("cpu", device_type="cpu")(lambda x: x @ x)(jnp.ones((2, 2))).dtype == (
    jnp.bfloat16
  )


def test_autocast_positional_device_type_disagreeing_with_device_type_is_a_type_error():
  with pytest.raises(
    TypeError, match=r"two device types, 'cuda' \(positional\) and device_type='cpu'"
  ):
    jaxamp.autocast("cuda", device_type="cpu")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, "torch.bfloat16"], ids=["jnp", "torch"])
def test_torch_spelling_with_a_positional_dtype_says_dtype_is_a_keyword(dtype):
  class TorchLikeDtype:  # torch.bfloat16's str, without importing torch
    def __str__(self):
      return "torch.bfloat16"

  given = TorchLikeDtype() if dtype == "torch.bfloat16" else dtype
  with pytest.raises(TypeError, match=r"jaxamp\.autocast\('cuda', dtype=jnp\.bfloat16\)"):
    jaxamp.autocast("cuda", given)


@pytest.mark.parametrize("device_type", ["cdua", "mps", "GPU"])
def test_autocast_unknown_positional_device_type_is_a_value_error_naming_the_choices(device_type):
  with pytest.raises(
    ValueError, match=rf"`device_type` must be one of {VALID_DEVICES}.*got '{device_type}'"
  ):
    jaxamp.autocast(device_type)


def test_torch_spelling_as_a_context_manager_is_the_same_type_error():
  messages = []
  for make in (lambda: jaxamp.autocast("cuda"), lambda: jaxamp.autocast(device_type="cuda")):
    with pytest.raises(TypeError, match="function transformation") as error:
      with make():
        pass
    messages.append(str(error.value))
  assert messages[0] == messages[1]


def test_help_of_autocast_lists_every_device_type_with_its_default_dtype():
  doc = " ".join(jaxamp.autocast.__doc__.split())
  assert '"cuda" (also "gpu", "rocm")' in doc
  for device_type in policy.device_types():
    dtype = jaxamp.get_autocast_dtype(device_type).name
    assert re.search(rf'"{device_type}" (\(also [^)]*\) )?{dtype}', doc), device_type


# --- unusual arguments and results ----------------------------------------------------------------


def test_autocast_passes_none_leaves_of_the_inputs_through():
  out = jaxamp.autocast(lambda d: d["x"] @ d["x"].T, device_type="cuda")(
    {"x": jnp.ones((2, 3)), "unused": None}
  )
  assert out.dtype == jnp.float16 and out.shape == (2, 2)


def test_autocast_returns_none_leaves_of_the_result():
  out = jaxamp.autocast(lambda x: {"y": matmul(x), "none": None}, device_type="cuda")(
    jnp.ones((2, 3))
  )
  assert out["none"] is None and out["y"].dtype == jnp.float16


def test_autocast_returns_none():
  assert jaxamp.autocast(lambda x: None, device_type="cuda")(jnp.ones(2)) is None


RESULTS = {"str": "label", "tuple_with_str": ("label", 3), "dict_with_str": {"tag": "label"}}


@pytest.mark.parametrize("kind", sorted(RESULTS))
def test_autocast_returns_string_results_as_the_function_does(kind):
  fun = lambda x: (matmul(x), RESULTS[kind])
  out = jaxamp.autocast(fun, device_type="cuda")(jnp.ones((2, 2)))
  assert out[1] == RESULTS[kind]


def test_autocast_of_a_function_of_static_arguments_only():
  assert jaxamp.autocast(lambda s: s.upper(), device_type="cuda")("abc") == "ABC"


CONSTANTS = {"int": 3, "float": 0.5, "bool": True, "numpy": np.ones(2, np.float32)}


@pytest.mark.parametrize("kind", sorted(set(CONSTANTS) - {"bool"}))
def test_autocast_returns_constant_results_without_jax_internal_types(kind):
  out = jaxamp.autocast(lambda x: CONSTANTS[kind], device_type="cuda")(jnp.ones(2))
  assert isinstance(out, jax.Array) or type(out) in (int, float, bool, np.ndarray), type(out)
  np.testing.assert_array_equal(out, CONSTANTS[kind])


def test_autocast_returns_a_bool_constant_as_is():
  assert jaxamp.autocast(lambda x: True, device_type="cuda")(jnp.ones(2)) is True


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.slow
def test_autocast_of_empty_arrays_works(device_type):
  def fun(x, w):
    h = jax.nn.softmax(x @ w)
    return h, jnp.sum(jnp.exp(h)), jax.lax.scan(lambda c, r: (c + r, None), jnp.zeros(3), h)[0]

  h, total, carry = jaxamp.autocast(fun, device_type=device_type)(
    jnp.ones((0, 4)), jnp.ones((4, 3))
  )
  assert h.shape == (0, 3) and h.dtype in (jnp.float16, jnp.bfloat16, jnp.float32)
  assert total == 0 and np.array_equal(carry, np.zeros(3))


@pytest.mark.slow
def test_gradients_of_zero_size_params_are_zero_size_float32():
  params = {"w": jnp.ones((0, 3)), "b": jnp.ones(3)}
  loss = jaxamp.autocast(
    lambda params: jnp.sum(jnp.ones((2, 0)) @ params["w"] + params["b"]), device_type="cuda"
  )
  grads = jax.grad(loss)(params)
  assert grads["w"].shape == (0, 3) and grads["w"].dtype == jnp.float32
  np.testing.assert_array_equal(grads["b"], np.full(3, 2.0))


def test_autocast_of_integer_and_float64_arrays_leaves_them_alone():
  ints = jaxamp.autocast(matmul, device_type="cuda")(jnp.ones((2, 2), jnp.int32))
  assert ints.dtype == jnp.int32


def test_autocast_function_errors_propagate_unchanged():
  with pytest.raises(ZeroDivisionError):
    jaxamp.autocast(lambda x: 1 / 0, device_type="cuda")(jnp.ones(2))


def test_autocast_call_with_wrong_arity_is_the_functions_type_error():
  with pytest.raises(TypeError, match="positional argument"):
    jaxamp.autocast(identity, device_type="cuda")(jnp.ones(2), jnp.ones(2))


# --- is_autocast_available, get_autocast_dtype, explain -------------------------------------------


@pytest.mark.parametrize("device_type", DEVICES)
def test_is_autocast_available_for_every_policy(device_type):
  assert jaxamp.is_autocast_available(device_type) is True


@pytest.mark.parametrize("device_type", ["metal", "mps", "CUDA", "", "cuda:x"])
def test_is_autocast_available_is_false_for_unknown_device_types(device_type):
  assert jaxamp.is_autocast_available(device_type) is False


@pytest.mark.parametrize("device_type", [3, ["cuda"]])
def test_is_autocast_available_non_string_is_a_type_error_naming_device_type(device_type):
  with pytest.raises(TypeError, match="`device_type` must be a string"):
    jaxamp.is_autocast_available(device_type)


@pytest.mark.parametrize(
  "device_type, dtype", [("cpu", jnp.bfloat16), ("cuda", jnp.float16), ("xpu", jnp.float16)]
)
def test_get_autocast_dtype_of_every_policy(device_type, dtype):
  assert jaxamp.get_autocast_dtype(device_type) == dtype


def test_get_autocast_dtype_unknown_device_type_names_the_choices():
  with pytest.raises(ValueError, match=rf"`device_type` must be one of {VALID_DEVICES}"):
    jaxamp.get_autocast_dtype("metal")


@pytest.mark.parametrize("device_type", [3, None])
def test_get_autocast_dtype_non_string_is_a_type_error(device_type):
  with pytest.raises(TypeError, match=rf"`device_type` must be a string, one of {VALID_DEVICES}"):
    jaxamp.get_autocast_dtype(device_type)


def test_explain_validates_like_autocast():
  with pytest.raises(ValueError, match="`device_type` must be one of"):
    jaxamp.explain(identity, device_type="metal")
  with pytest.raises(ValueError, match="`dtype` must be one of"):
    jaxamp.explain(identity, device_type="cuda", dtype=jnp.int8)
  with pytest.raises(TypeError, match="callable"):
    jaxamp.explain(3, device_type="cuda")


# --- custom_fwd, custom_bwd, register_op, autocast_disabled ---------------------------------------


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.float64, "float8_e4m3fn", object()])
def test_custom_fwd_unsupported_cast_inputs_is_a_value_error_naming_the_choices(dtype):
  with pytest.raises(ValueError, match="`cast_inputs` must be one of jnp.float32, jnp.float16"):
    jaxamp.custom_fwd(cast_inputs=dtype)(identity)


@pytest.mark.parametrize("fun", [3, "f"])
def test_custom_fwd_of_a_non_callable_is_a_type_error(fun):
  with pytest.raises(TypeError, match="custom_fwd decorates a callable"):
    jaxamp.custom_fwd(fun, cast_inputs=jnp.float32)


@pytest.mark.parametrize("fun", [3, None])
def test_custom_bwd_of_a_non_callable_is_a_type_error(fun):
  with pytest.raises(TypeError, match="custom_bwd decorates a callable"):
    jaxamp.custom_bwd(fun)


def test_custom_fwd_with_a_positional_dtype_points_to_cast_inputs():
  with pytest.raises(TypeError) as error:
    jaxamp.custom_fwd(jnp.float32)(identity)
  assert "cast_inputs" in str(error.value)


@pytest.mark.parametrize("name", ["", 3, None])
def test_register_op_name_must_be_a_non_empty_string(name):
  with pytest.raises(TypeError, match="`name` must be a non-empty string"):
    jaxamp.register_op(name)


def test_register_op_used_without_a_name_is_a_type_error():
  with pytest.raises(TypeError, match="`name` must be a non-empty string; got <function"):
    jaxamp.register_op(identity)


@pytest.mark.parametrize("category", ["fp8", "FLOAT32", 3])
def test_register_op_unknown_category_names_the_choices(category):
  with pytest.raises(ValueError, match=r"`category` must be one of \['lower', 'float32'"):
    jaxamp.register_op("bad_input_op", category=category)


def test_register_op_decorates_only_callables():
  with pytest.raises(TypeError, match="decorates a callable"):
    jaxamp.register_op("bad_input_op")(3)


def test_autocast_disabled_takes_no_arguments():
  with pytest.raises(TypeError):
    jaxamp.autocast_disabled("cuda")


# --- torch's names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "name, spelling",
  [
    ("GradScaler", r"jaxamp\.dynamic_loss_scale\(optax.*jaxamp\.scale_loss.*jaxamp\.scaler"),
    ("amp", r"jaxamp is itself torch\.amp: `jaxamp\.autocast`.*`jaxamp\.dynamic_loss_scale`"),
    ("cuda", r'jaxamp\.autocast\(f, device_type="cuda"\)'),
    ("is_autocast_enabled", r"a function transformation.*jaxamp\.explain.*autocast_disabled"),
  ],
)
def test_torch_names_raise_an_attribute_error_naming_the_jax_spelling(name, spelling):
  with pytest.raises(
    AttributeError, match=rf"module 'jaxamp' has no attribute '{name}': .*{spelling}"
  ):
    getattr(jaxamp, name)
  assert not hasattr(jaxamp, name)


def test_other_missing_names_raise_the_usual_attribute_error():
  with pytest.raises(AttributeError, match=r"^module 'jaxamp' has no attribute 'GradScalar'$"):
    jaxamp.GradScalar  # noqa: B018


def test_a_users_forbidden_op_names_its_registration_not_binary_cross_entropys_advice():
  @jaxamp.register_op("guarded_tanh", category="forbidden")
  def guarded_tanh(a):
    return jnp.tanh(a) * 2

  with pytest.raises(RuntimeError, match="`guarded_tanh` is FORBIDDEN.*autocast_disabled") as error:
    jaxamp.autocast(lambda a: guarded_tanh(a @ a), device_type="cuda")(jnp.ones((2, 2)))
  assert "with-logits" not in str(error.value)
