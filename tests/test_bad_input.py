"""Bad input: a one-line error naming the fix, raised before any model loads, with the store untouched."""
import json

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from harness.running.config import CONF_DIR, USER_ERRORS
from harness.running.driver import prepare
from harness.running.schema import register
from systems.registry import SystemConfigError

register()

# (overrides, a phrase the message must contain) — each must fail in composition or validation.
CASES = [
    (["system=nosuch"], "nosuch"),                                          # unknown system name
    (["task=nosuch"], "nosuch"),                                            # unknown task name
    (["model=nosuch"], "nosuch"),                                           # unknown model name
    (["+exp=nosuch"], "nosuch"),                                            # unknown experiment
    (["system.batch_size=many"], "many"),                                   # wrong type
    (["seed=1.5"], "seed"),
    (["model.max_model_len=big"], "big"),
    (["system.batchsize=2"], "batchsize"),                                  # misspelled key
    (["+system.engine.pagesize=8"], "pagesize"),                            # appended unknown key
    (["+model.dtyp=float32"], "dtyp"),
    (["+exp=quickstart", "exp.systems=[nosuch]"], "nosuch"),
    (["+exp=quickstart", "exp.kind=nosuch"], "exp.kind"),
    (["system.backend=tpu"], "backend"),
    (["system.batch_size=0"], "batch_size"),
    (["system=dense", "system.policy=nosuch"], "nosuch"),                   # unknown policy
    (["system=dense", "system.policy=indicators"], "unknown policy"),       # a helper module is not a policy
    (["system=dense", "system.policy=base"], "unknown policy"),
    (["system=quest", "+system.params.budgte=512"], "budgte"),              # unknown policy param
    (["system=quest", "system.params.budget=0"], "budget"),                 # budget <= 0
    (["system=cake", "system.params.budget=-5"], "budget"),
    (["system=snapkv", "system.params.budget=100000"], "exceeds the context"),   # budget > context
    (["system=quest", "system.params.budget=1000"], "engine.page_size"),    # whole pages of the engine's size
    (["system=flexicache", "system.params.budget=8"], "engine.page_size"),
    (["system=lserve", "system.params.sink_tokens=100"], "engine.page_size"),
    (["system=hf", "system.policy=quest"], "backend"),                      # hf runs dense only
    (["task.family=nosuch"], "unknown task family"),
    (["+task.params.lenghts=[1]"], "lenghts"),                              # unknown task param
    (["task.limit=0"], "task.limit"),
    (["task.fraction=1.5"], "task.fraction"),
    (["task.params.mode=bogus"], "mode"),
    (["task.params.lengths=[-5]"], "lengths"),
    (["task=recall", "task.params.passage_tokens=[5000]"], "passage_tokens"),
    (["model.max_input_tokens=9000"], "max_input_tokens"),
    (["model.path=/nonexistent/model"], "model.path"),
    (["task=longbench_qasper", "task.params.on_malformed=maybe"], "on_malformed"),
    (["system=dense", "system.engine.max_num_seqs=0"], "max_num_seqs"),       # would admit nothing: a silent hang
    (["system=dense", "system.engine.page_size=0"], "page_size"),
    (["system=dense", "system.engine.device_memory_gb=-1"], "device_memory_gb"),
    (["system=dense", "system.engine.host_memory_gb=-1"], "host_memory_gb"),
    (["system=dense", "system.engine.max_num_batched_tokens=0"], "max_num_batched_tokens"),
    (["task=needlebench_srt", "task.params.lengths=1500"], "lengths"),           # a scalar where a list is due
    (["model.dtype=float64"], "model.dtype"),
]


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def _check_model_path(cfg):
    from harness.integrations.assets import model_dir
    if cfg.model.path:
        model_dir(cfg.model.path)


@pytest.mark.parametrize("overrides, phrase", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_config_fails_in_one_line(overrides, phrase, tmp_path):
    with pytest.raises((ConfigCompositionException, *USER_ERRORS, SystemConfigError, ValueError)) as info:
        cfg = _compose([*overrides, f"results_dir={tmp_path}"])
        prepare(cfg)
        _check_model_path(cfg)
    exc = info.value
    text = str(exc) + str(getattr(exc, "__cause__", "") or "")
    assert phrase in text, text
    assert not any(tmp_path.iterdir())


def test_enough_cases():
    assert len(CASES) >= 30


def test_prompt_too_long_with_truncation_off():
    from harness.running.prompts import render_all
    from tasks.base import Sample, TaskError

    class Tok:
        bos_token_id = None
        def encode(self, text, add_special_tokens=False):
            return list(range(len(text.split())))
    s = Sample(id="x", context="word " * 50, question="", answers=("a",), max_new_tokens=4, truncation="none",
               chat_template=False)
    with pytest.raises(TaskError, match="max_input_tokens"):
        render_all([s], Tok(), max_input_tokens=10, max_model_len=100)


def test_device_pool_too_small_names_the_size(tiny_llama_dir):
    from omegaconf import OmegaConf

    from harness.running.schema import SystemConfig
    from systems.registry import check_capacity
    sys_cfg = OmegaConf.merge(OmegaConf.structured(SystemConfig),
                              {"name": "engine-dense", "backend": "engine", "engine": {"device_memory_gb": 1e-5}})
    with pytest.raises(SystemConfigError, match=r"set engine.device_memory_gb >= [0-9.]+"):
        check_capacity(sys_cfg, tiny_llama_dir, 4, prompt_len=1500, max_new_tokens=16, max_model_len=2048)


def test_missing_vllm_backend_names_the_fix(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *a, **k):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    from systems.vllm import VLLMSystem
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception) as info:
        VLLMSystem(str(tmp_path))
    assert "vllm" in str(info.value).lower() and "install" in str(info.value).lower()


def test_unreachable_hub_names_the_key(monkeypatch):
    from tasks.base import TaskError, load_task
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = load_task("longbench", "lb", {"datasets": ["qasper"]})
    with pytest.raises(TaskError, match="data_dir"):
        task.samples(None)


def test_corrupted_model_cache_is_detected(tmp_path):
    from harness.integrations.assets import MARKER, _fingerprint, is_verified
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    (folder / MARKER).write_text(json.dumps({"files": _fingerprint(folder)}))
    assert is_verified(folder)
    (folder / "model.safetensors").write_bytes(b"x" * 99)   # truncated download / partial write
    assert not is_verified(folder)
    (folder / MARKER).unlink()                              # interrupted before verification
    assert not is_verified(folder)


@pytest.mark.parametrize("mode", ["skip", "fail"])
def test_malformed_rows_skip_or_fail(tmp_path, mode):
    from tasks.base import TaskError, load_task
    good = {"input": "q?", "context": "ctx", "answers": ["a"], "length": 10, "dataset": "qasper",
            "language": "en", "all_classes": None, "_id": "1"}
    (tmp_path / "qasper.jsonl").write_text(json.dumps(good) + "\n" + '{"input": 3}\n' + "not json\n")
    task = load_task("longbench", "lb", {"datasets": ["qasper"], "data_dir": str(tmp_path), "on_malformed": mode})
    if mode == "fail":
        with pytest.raises(TaskError):
            task.samples(None)
    else:
        assert len(task.samples(None)) == 1


SMOLLM2_SHAPE = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                 "hidden_size": 576, "head_dim": 64}


def _system_files():
    return sorted(p.stem for p in (CONF_DIR / "system").glob("*.yaml"))


@pytest.mark.parametrize("name", _system_files())
def test_every_system_file_validates(name, tmp_path):
    """Each conf/system file passes the checks made before any model loads (schema, policy params, the policy's
    configure on the shipped model's shape); only its config.json is read: the folder holds no weights."""
    import json

    from harness.running.config import load_group
    from harness.running.grid import check_budget
    from harness.running.schema import ModelConfig, SystemConfig
    from systems.registry import check_dims, check_system
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    system = load_group("system", name, SystemConfig)
    check_budget(system, OmegaConf.structured(ModelConfig))
    check_system(system)
    check_dims(system, tmp_path, 8192, model_name=ModelConfig.name)    # profiles are found by the model's name


@pytest.mark.parametrize("name", _system_files())
def test_every_system_refuses_a_too_small_pool_before_loading(name, tmp_path):
    import json

    from harness.running.config import load_group
    from harness.running.schema import SystemConfig
    from systems.registry import backend_of, check_capacity
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    system = load_group("system", name, SystemConfig)
    if not backend_of(system).kv_capacity:
        pytest.skip("a backend without a checked device pool (hf, vllm) sizes its own")
    system.engine.device_memory_gb = 1e-4
    with pytest.raises(SystemConfigError) as err:
        check_capacity(system, tmp_path, 2, prompt_len=4000, max_new_tokens=16, max_model_len=8192,
                       model_name="smollm2-135m-instruct")
    assert "\n" not in str(err.value) and "set engine.device_memory_gb >=" in str(err.value)


def test_unwritable_results_dir_is_one_line_before_any_model(tmp_path, tiny_llama_dir):
    from harness.running.config import UserError
    from harness.running.driver import run
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = _compose(["+exp=quickstart", "exp.systems=[dense]", f"model.path={tiny_llama_dir}",
                    f"results_dir={blocker / 'results'}",
                    "model.dtype=float32"])
    with pytest.raises(UserError, match="results folder .* is not writable") as info:
        run(cfg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("exp", ["offline_throughput", "memory", "loaded_host", "online_sweep"])
def test_speed_experiments_refuse_a_too_small_pool_before_loading(exp, tmp_path, tiny_llama_dir, monkeypatch):
    import harness.experiments.online_sweep.rates
    import harness.running.workspace
    from harness.running.config import UserError
    from harness.running.driver import run

    def must_not_load(*args, **kwargs):
        raise AssertionError("a system was started before the capacity check")
    monkeypatch.setattr(harness.running.workspace, "build_system", must_not_load)
    monkeypatch.setattr(harness.experiments.online_sweep.rates, "start_server", must_not_load)
    cfg = _compose([f"+exp={exp}", "exp.systems=[dense]", f"model.path={tiny_llama_dir}", "model.dtype=float32",
                    f"results_dir={tmp_path / 'results'}",
                    "++exp.params.system_overrides={engine:{device_memory_gb:0.00001}}"])
    with pytest.raises(UserError, match=r"set engine.device_memory_gb >= [0-9.]+") as info:
        run(cfg)
    assert "\n" not in str(info.value)
    assert not any(p.is_dir() for p in (tmp_path / "results").glob("*/*"))      # no cell folder was made


def test_a_damaged_cached_checkpoint_is_named_and_rebuilt(tmp_path, monkeypatch, caplog):
    """The README's promise: a corrupted cache is rebuilt; the warning names what is damaged, and the dimension
    checks made before any model loads wait for the rebuild instead of failing on the broken config.json."""
    from harness.integrations import assets
    monkeypatch.setenv("KVHARNESS_CACHE", str(tmp_path))
    folder = tmp_path / assets.MODEL_NAME
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    (folder / assets.MARKER).write_text(json.dumps({"files": assets._fingerprint(folder)}))
    assert assets.known_model_dir() == folder
    (folder / "config.json").write_text('{"num_hidden_layers": 30,\n "hidden')
    assert assets.known_model_dir() is None

    def convert(out, progress):
        (out / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    monkeypatch.setattr(assets, "_convert", convert)
    assert assets.prepare(progress=False) == folder
    assert "config.json differs from what verified.json recorded; rebuilding it" in caplog.text
    assert assets.is_verified(folder) and json.loads((folder / "config.json").read_text()) == SMOLLM2_SHAPE


def test_an_unwritable_model_cache_is_one_line(tmp_path, monkeypatch):
    from harness.integrations import assets
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("KVHARNESS_CACHE", str(tmp_path / "a_file" / "cache"))
    with pytest.raises(assets.AssetError, match="set KVHARNESS_CACHE to a folder you can write") as info:
        assets.prepare(progress=False)
    assert "\n" not in str(info.value)


def test_a_held_build_lock_names_its_holder_not_a_compiler(tmp_path, monkeypatch):
    import fcntl
    import os

    from systems.engine.ops import cpu_kernels
    monkeypatch.setenv("KVHARNESS_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "BUILD_WAIT_S", 0.2)
    folder = cpu_kernels.build_dir()
    folder.mkdir(parents=True)
    with open(folder / "kvharness.lock", "a+") as holder:          # another build in progress: this process's pid
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.write(str(os.getpid()))
        holder.flush()
        with pytest.raises(cpu_kernels.BuildLockHeld) as info:
            cpu_kernels._build()
    message = f"{info.value} {cpu_kernels.build_fix(info.value)}"
    assert f"process {os.getpid()} still holds" in message and f"kill {os.getpid()}" in message
    assert "KVHARNESS_BUILD_WAIT_S" in message and "gcc" not in message and "compiler" not in message
