"""Bad input to every public function: a clear ValueError/TypeError naming what is valid, or it
works as a demanding user expects. One row of the matrix per test.

Each row names the expected behaviour: a clear error naming what is valid, or it works.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._src.policies import policy

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
DEVICES = ("cpu", "cuda", "xpu")
VALID_DEVICES = re.escape(str(policy.device_types()))  # ('cpu', 'cuda', ...): every table


def identity(x):
  return x


def matmul(x):
  return x @ x.T


def scaler_state(**kwargs):
  return jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs).init(PARAMS)


# ------------------------------------------------------------------------------------------------
# autocast: arguments.


@pytest.mark.parametrize("device_type", ["GPU", "CUDA", "cuda:0", "mps", "metal", ""])
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


@pytest.mark.parametrize(
  "dtype", [jnp.float32, jnp.float64, jnp.int8, jnp.float8_e5m2, "half?", 3, object()]
)
def test_autocast_unsupported_dtype_is_a_value_error_naming_the_valid_ones(dtype):
  valid = "`dtype` must be one of jnp.float16, jnp.bfloat16 or jnp.float8_e4m3fn"
  with pytest.raises(ValueError, match=valid):
    jaxamp.autocast(identity, device_type="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", np.float16, jnp.dtype("bfloat16"), "bfloat16"])
def test_autocast_accepts_any_spelling_of_a_low_dtype(dtype):
  out = jaxamp.autocast(matmul, device_type="cuda", dtype=dtype)(jnp.ones((2, 2)))
  assert out.dtype == jnp.dtype(dtype)


def test_autocast_decorator_form_validates_its_arguments_before_decorating():
  with pytest.raises(ValueError, match="`dtype` must be one of"):
    jaxamp.autocast(device_type="cuda", dtype=jnp.int8)


@pytest.mark.parametrize("fun", [3, "cuda", jnp.ones(2)])
def test_autocast_of_a_non_callable_is_a_type_error(fun):
  with pytest.raises(TypeError, match="autocast transforms a callable"):
    jaxamp.autocast(device_type="cuda")(fun)


def test_autocast_device_type_may_be_the_second_positional_argument():
  x = jnp.ones((2, 2))
  out = jaxamp.autocast(matmul, "cuda")(x)
  assert out.dtype == jnp.float16
  assert out.tobytes() == jaxamp.autocast(matmul, device_type="cuda")(x).tobytes()


def test_autocast_options_after_the_device_type_are_keyword_only():
  with pytest.raises(TypeError, match="positional argument"):
    jaxamp.autocast(identity, "cuda", jnp.bfloat16)


@pytest.mark.parametrize("device_type", ["cdua", "mps", "GPU"])
def test_autocast_unknown_positional_device_type_is_a_value_error_naming_the_choices(device_type):
  with pytest.raises(ValueError, match=rf"`device_type` must be one of {VALID_DEVICES}"):
    jaxamp.autocast(device_type)


def test_autocast_positional_device_type_disagreeing_with_device_type_is_a_type_error():
  with pytest.raises(
    TypeError, match=r"two device types, 'cuda' \(positional\) and device_type='cpu'"
  ):
    jaxamp.autocast("cuda", device_type="cpu")


@pytest.mark.parametrize(
  "name, value",
  [("enabled", 1), ("enabled", "yes"), ("enabled", np.True_), ("cache_enabled", "no")],
)
def test_autocast_non_bool_flags_are_type_errors_naming_the_flag(name, value):
  with pytest.raises(TypeError, match=f"`{name}` must be a bool"):
    jaxamp.autocast(identity, device_type="cuda", **{name: value})


# ------------------------------------------------------------------------------------------------
# autocast: unusual arguments and results.


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
def test_autocast_of_empty_arrays_works(device_type):
  def fun(x, w):
    h = jax.nn.softmax(x @ w)
    return h, jnp.sum(jnp.exp(h)), jax.lax.scan(lambda c, r: (c + r, None), jnp.zeros(3), h)[0]

  h, total, carry = jaxamp.autocast(fun, device_type=device_type)(
    jnp.ones((0, 4)), jnp.ones((4, 3))
  )
  assert h.shape == (0, 3) and h.dtype in (jnp.float16, jnp.bfloat16, jnp.float32)
  assert total == 0 and np.array_equal(carry, np.zeros(3))


def test_gradients_of_zero_size_params_are_zero_size_float32():
  params = {"w": jnp.ones((0, 3)), "b": jnp.ones(3)}
  loss = jaxamp.autocast(lambda p: jnp.sum(jnp.ones((2, 0)) @ p["w"] + p["b"]), device_type="cuda")
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


# ------------------------------------------------------------------------------------------------
# is_autocast_available, get_autocast_dtype, explain.


@pytest.mark.parametrize("device_type", DEVICES)
def test_is_autocast_available_for_every_policy(device_type):
  assert jaxamp.is_autocast_available(device_type) is True


@pytest.mark.parametrize("device_type", ["metal", "mps", "CUDA", ""])
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


# ------------------------------------------------------------------------------------------------
# custom_fwd, custom_bwd, register_op, autocast_disabled.


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64, "float8_e4m3fn", object()])
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


# ------------------------------------------------------------------------------------------------
# dynamic_loss_scale.


@pytest.mark.parametrize("inner", [None, lambda g: g, optax.sgd])
def test_dynamic_loss_scale_inner_must_be_a_gradient_transformation(inner):
  with pytest.raises(TypeError, match="`inner` must be an optax GradientTransformation"):
    jaxamp.dynamic_loss_scale(inner)


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (dict(init_scale=0.0), ValueError, "`init_scale` must be > 0 and finite"),
    (dict(init_scale=-1.0), ValueError, "`init_scale` must be > 0 and finite"),
    (dict(init_scale=float("inf")), ValueError, "`init_scale` must be > 0 and finite"),
    (dict(init_scale=float("nan")), ValueError, "`init_scale` must be > 0 and finite"),
    (dict(init_scale=1e39), ValueError, "`init_scale` must be > 0 and finite in float32"),
    (dict(init_scale="1"), TypeError, "`init_scale` must be a real number"),
    (dict(init_scale=jnp.float32(4.0)), TypeError, "`init_scale` must be a real number"),
    (dict(growth_factor=1.0), ValueError, "`growth_factor` must be > 1.0"),
    (dict(growth_factor=float("nan")), ValueError, "`growth_factor` must be > 1.0"),
    (dict(backoff_factor=1.0), ValueError, "`backoff_factor` must satisfy 0 < backoff_factor < 1"),
    (dict(backoff_factor=0.0), ValueError, "`backoff_factor` must satisfy 0 < backoff_factor < 1"),
    (dict(growth_interval=0), ValueError, "`growth_interval` must be an int in"),
    (dict(growth_interval=2.0), TypeError, "`growth_interval` must be an int"),
    (dict(growth_interval=True), TypeError, "`growth_interval` must be an int"),
    (dict(enabled="yes"), TypeError, "`enabled` must be a bool"),
  ],
)
def test_dynamic_loss_scale_rejects_bad_hyperparameters_naming_them(kwargs, error, message):
  with pytest.raises(error, match=message):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


def test_dynamic_loss_scale_accepts_numpy_scalars():
  state = jaxamp.dynamic_loss_scale(
    optax.sgd(0.1), init_scale=np.float32(8.0), growth_interval=np.int64(3)
  ).init(PARAMS)
  assert state.scale == 8.0 and state.growth_interval == 3


def test_dynamic_loss_scale_options_are_keyword_only():
  with pytest.raises(TypeError, match="positional argument"):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), 2.0)


def test_update_with_axis_name_outside_a_mapped_context_names_the_unbound_axis():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data")
  with pytest.raises(NameError, match="unbound axis name: data"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("state", ["inner", "none"])
def test_update_with_a_state_that_is_not_the_scalers_is_a_type_error(state):
  tx = jaxamp.dynamic_loss_scale(optax.adam(0.1))
  wrong = optax.adam(0.1).init(PARAMS) if state == "inner" else None
  with pytest.raises(TypeError, match="DynamicLossScaleState"):
    tx.update(PARAMS, wrong, PARAMS)


def test_update_skips_none_leaves_and_checks_the_others():
  tx = jaxamp.dynamic_loss_scale(optax.adam(0.1))
  params = {"w": jnp.ones(3), "frozen": None}
  state, update = tx.init(params), jax.jit(tx.update)
  updates, new_state = update({"w": jnp.ones(3), "frozen": None}, state, params)
  assert updates["frozen"] is None and not new_state.found_inf
  _, new_state = update({"w": jnp.full(3, jnp.nan), "frozen": None}, state, params)
  assert new_state.found_inf


def test_update_of_zero_size_params_works_and_finds_no_overflow_in_them():
  tx = jaxamp.dynamic_loss_scale(optax.adam(0.1))
  params = {"empty": jnp.ones((0, 4)), "w": jnp.ones(3)}
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(params, state, params)
  assert updates["empty"].shape == (0, 4) and not new_state.found_inf
  assert jaxamp.scaler.get_scale(new_state) == 2.0**16


def test_update_of_an_empty_tree_is_a_finite_step():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  updates, state = jax.jit(tx.update)({}, tx.init({}), {})
  assert updates == {} and not state.found_inf and state.growth_tracker == 1


# ------------------------------------------------------------------------------------------------
# scale_loss, get_scale, state_dict, load_state_dict.

NO_SCALER = {
  "optax state": optax.sgd(0.1).init(PARAMS),
  "None": None,
  "params": PARAMS,
  "the transformation": jaxamp.dynamic_loss_scale(optax.sgd(0.1)),
}
HELPERS = {
  "scale_loss": lambda state: jaxamp.scale_loss(jnp.ones(()), state),
  "get_scale": jaxamp.scaler.get_scale,
  "state_dict": jaxamp.scaler.state_dict,
  "load_state_dict": lambda state: jaxamp.scaler.load_state_dict(state, {"scale": 1.0}),
}


@pytest.mark.parametrize("helper", sorted(HELPERS))
@pytest.mark.parametrize("state", sorted(NO_SCALER))
def test_helpers_on_a_state_without_a_scaler_name_what_they_searched(helper, state):
  with pytest.raises(ValueError, match="contains no `DynamicLossScaleState`: searched"):
    HELPERS[helper](NO_SCALER[state])


@pytest.mark.parametrize("loss", ["loss", object()])
def test_scale_loss_of_a_non_array_is_a_type_error(loss):
  with pytest.raises(TypeError, match="`loss` must be an array or a pytree of arrays"):
    jaxamp.scale_loss(loss, scaler_state())


def test_scale_loss_of_none_is_a_type_error():
  with pytest.raises(TypeError, match="`loss` must be an array"):
    jaxamp.scale_loss(None, scaler_state())


def test_scale_loss_keeps_none_leaves_of_a_tree_of_losses():
  scaled = jaxamp.scale_loss({"main": jnp.ones(()), "aux": None}, scaler_state(init_scale=4.0))
  assert scaled["aux"] is None and scaled["main"] == 4.0


def test_scale_loss_of_an_empty_array_is_empty():
  assert jaxamp.scale_loss(jnp.ones((0,)), scaler_state()).shape == (0,)


STATE_DICT = {
  "scale": 8.0,
  "growth_factor": 2.0,
  "backoff_factor": 0.5,
  "growth_interval": 10,
  "_growth_tracker": 3,
}


@pytest.mark.parametrize("missing", sorted(STATE_DICT))
def test_load_state_dict_with_a_missing_key_names_the_expected_keys(missing):
  partial = {k: v for k, v in STATE_DICT.items() if k != missing}
  with pytest.raises(ValueError, match=rf"`state_dict` lacks the keys \['{missing}'\]; expected"):
    jaxamp.scaler.load_state_dict(scaler_state(), partial)


def test_load_state_dict_ignores_extra_keys_like_torch():
  loaded = jaxamp.scaler.load_state_dict(scaler_state(), {**STATE_DICT, "extra": 1, "step": 7})
  assert jaxamp.scaler.state_dict(loaded) == STATE_DICT


@pytest.mark.parametrize(
  "d, error, message",
  [
    (None, TypeError, "`state_dict` must be a dict, got NoneType"),
    ([("scale", 1.0)], TypeError, "`state_dict` must be a dict, got list"),
    ({}, ValueError, "`state_dict` is empty"),
    ({**STATE_DICT, "scale": "8"}, TypeError, "`scale` must be a real number"),
    ({**STATE_DICT, "scale": -1.0}, ValueError, "`scale` must be >= 0 and finite"),
    ({**STATE_DICT, "scale": float("nan")}, ValueError, "`scale` must be >= 0 and finite"),
    ({**STATE_DICT, "_growth_tracker": -1}, ValueError, "`_growth_tracker` must be an int in"),
    ({**STATE_DICT, "_growth_tracker": 0.5}, TypeError, "`_growth_tracker` must be an int"),
    ({**STATE_DICT, "growth_interval": 0}, ValueError, "`growth_interval` must be an int in"),
  ],
)
def test_load_state_dict_rejects_malformed_values_naming_them(d, error, message):
  with pytest.raises(error, match=message):
    jaxamp.scaler.load_state_dict(scaler_state(), d)


def test_load_state_dict_accepts_numpy_scalars():
  loaded = jaxamp.scaler.load_state_dict(
    scaler_state(), {**STATE_DICT, "scale": np.float32(8.0), "_growth_tracker": np.int64(3)}
  )
  assert jaxamp.scaler.state_dict(loaded) == STATE_DICT


def test_load_state_dict_accepts_the_array_that_get_scale_returns():
  d = {**STATE_DICT, "scale": jaxamp.scaler.get_scale(scaler_state(init_scale=8.0))}
  assert jaxamp.scaler.state_dict(jaxamp.scaler.load_state_dict(scaler_state(), d)) == STATE_DICT


def test_load_state_dict_rejects_a_growth_tracker_at_or_past_the_growth_interval():
  with pytest.raises(ValueError, match="`_growth_tracker`"):
    jaxamp.scaler.load_state_dict(scaler_state(), {**STATE_DICT, "_growth_tracker": 10})


def test_state_dict_of_a_disabled_scaler_is_empty_and_loading_into_it_is_a_no_op():
  state = scaler_state(enabled=False)
  assert jaxamp.scaler.state_dict(state) == {}
  assert jaxamp.scaler.load_state_dict(state, {"anything": 1}) is state


# ------------------------------------------------------------------------------------------------
# multi_steps.


@pytest.mark.parametrize("k", [0, -1])
def test_multi_steps_non_positive_k_is_a_value_error(k):
  with pytest.raises(ValueError, match="every_k_schedule"):
    jaxamp.multi_steps(optax.sgd(0.1), k)


@pytest.mark.parametrize("k", [2.5, "a"])
def test_multi_steps_non_integer_k_is_a_type_error(k):
  with pytest.raises(TypeError, match="every_k_schedule"):
    jaxamp.multi_steps(optax.sgd(0.1), k)


@pytest.mark.parametrize("inner", [None, lambda g: g])
def test_multi_steps_inner_must_be_a_gradient_transformation(inner):
  with pytest.raises(TypeError, match="`inner` must be an optax GradientTransformation"):
    jaxamp.multi_steps(inner, 2)


def applies_every_second_step(k) -> bool:
  tx = jaxamp.multi_steps(optax.sgd(1.0), k)
  state, update = tx.init(PARAMS), jax.jit(tx.update)
  first, state = update(PARAMS, state, PARAMS)
  second, state = update(PARAMS, state, PARAMS)
  return bool(np.all(first["w"] == 0) and np.all(second["w"] == -1.0))


@pytest.mark.parametrize("k", [2, lambda step: 2], ids=["int", "schedule"])
def test_multi_steps_accepts_an_int_or_a_schedule(k):
  assert applies_every_second_step(k)


def test_multi_steps_accepts_a_numpy_integer():
  assert applies_every_second_step(np.int64(2))
