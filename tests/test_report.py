"""One voice: warnings and errors as single `paro-jax:` lines, third-party noise in the run's log,
no jax in `plan`, no CUDA plugin probed without a driver, the launcher's output folded."""

import io
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest

from paro_jax import cli, report
from paro_jax.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["train", "--model", "test", "--steps", "1", "--warmup", "1", "--batch-size", "8"]


@pytest.fixture
def hooks():
  """The tests that install the reporter themselves give the next test Python's hooks back."""
  restore = report.install()
  yield
  restore()


def test_main_called_from_python_leaves_no_hooks(capsys):
  def hooks_now():
    root = logging.getLogger()
    return sys.excepthook, sys.unraisablehook, warnings.showwarning, list(root.handlers), root.level

  before = hooks_now()
  main(["plan", "--model", "tiny", "--nodes", "2", "--json"])
  assert hooks_now() == before
  assert not any(isinstance(h, report._Handler) for h in logging.getLogger().handlers)


def test_one_line_drops_newlines_and_object_reprs():
  text = (
    'step 4 is damaged (ValueError: Error opening "zarr" driver:\n  '
    "<bound method pybind11_detail_function_record_v1_system_libstdcpp_gxx_abi_1xxx.<locals>.f "
    "of <tensorstore.Spec object at 0x7f3a2b1c>>) at <foo.Bar object at 0xDEADbeef>; next"
  )
  line = report.one_line(text)
  assert "\n" not in line and "pybind11" not in line and "0x" not in line
  assert line.startswith('step 4 is damaged (ValueError: Error opening "zarr" driver:')
  assert line.endswith("at ; next")
  # As the damaged-checkpoint warning quotes it: cut short, after TensorStore's lead.
  cut = (
    "step 2 is damaged (Exception: Encountered error while reading array index: (slice(0, 256, "
    "1), slice(0, 4, 1)). See full TensorStore details: <bound method pybind11_detail_function_"
    "record_v1_system_libstdcpp_gxx_abi_1xxx_use_cxx11_); falling back to step 1"
  )
  assert report.one_line(cut) == (
    "step 2 is damaged (Exception: Encountered error while reading array index: (slice(0, 256, "
    "1), slice(0, 4, 1)). ); falling back to step 1"
  )


def test_project_warning_is_one_line_and_the_log_keeps_it(tmp_path, capsys):
  """A project warning (the --warmup one, raised while the run is configured) is
  `paro-jax: warning: ...` with no file, line or source echo; the run directory's log has it
  in full once the directory exists; the data error after it is the one error line."""
  out = tmp_path / "run"
  out.mkdir()
  data = tmp_path / "empty.txt"
  data.write_text("")
  with pytest.raises(SystemExit) as e:
    main([*TRAIN, "--warmup", "5", "--data", str(data), "--out", str(out)])
  assert e.value.code == 2
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 2, err
  assert err[0].startswith("paro-jax: warning: --warmup 5 is more than --steps 1")
  assert err[1].startswith("paro-jax: error: ") and "empty.txt" in err[1]
  log = (out / report.LOG_NAME).read_text()
  assert "warning: --warmup 5 is more than --steps 1" in log and "empty.txt" in log


def test_third_party_records_and_warnings_go_to_the_log(tmp_path, capsys, hooks):
  report.set_log_dir(str(tmp_path))
  logging.getLogger("absl").error("Metadata file does not exist: /x/_CHECKPOINT_METADATA")
  logging.getLogger("absl").info("Saving checkpoint at step 3")
  logging.getLogger("somelib").error("the disk controller is on fire\nTraceback: ...")
  warnings.warn_explicit("old API", DeprecationWarning, "/site-packages/lib.py", 7)
  err = capsys.readouterr().err
  # Known noise and INFO: the log only; an unknown third-party ERROR: one folded line.
  assert err.splitlines() == [
    f"paro-jax: warning: somelib: the disk controller is on fire (full text in "
    f"{tmp_path / report.LOG_NAME})"
  ]
  log = (tmp_path / report.LOG_NAME).read_text()
  for text in ("Metadata file does not exist", "Saving checkpoint at step 3", "old API"):
    assert text in log


def test_unraisable_event_loop_closed_is_logged_not_shown(tmp_path, capsys, hooks):
  """What TensorStore's callbacks into a closed asyncio loop raise after a failed save."""
  report.set_log_dir(str(tmp_path))

  class Unraisable:
    exc_type, exc_value = RuntimeError, RuntimeError("Event loop is closed")
    exc_traceback, err_msg, object = None, None, None

  sys.unraisablehook(Unraisable)
  assert capsys.readouterr().err == ""
  assert "Event loop is closed" in (tmp_path / report.LOG_NAME).read_text()


def test_a_bad_flag_creates_no_run_directory(tmp_path, capsys):
  out = tmp_path / "never"
  with pytest.raises(SystemExit):
    main([*TRAIN, "--strategy", "GNI", "--mesh", "2x4", "--out", str(out)])
  assert not out.exists()
  assert capsys.readouterr().err.count("\n") == 1


def test_unknown_flag_gets_the_subcommands_usage(capsys):
  for argv, usage in (
    (["train", "--bogus", "1"], "usage: paro-jax train "),
    (["plan", "--nodes", "2", "--bogus"], "usage: paro-jax plan "),
    (["export", "run", "--out", "x", "--bogus"], "usage: paro-jax export "),
  ):
    with pytest.raises(SystemExit) as e:
      main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments: --bogus" in err, err


def test_export_takes_the_run_positionally_or_as_run():
  assert cli._parse(["export", "runs/a", "--out", "hf"]).run == "runs/a"
  assert cli._parse(["export", "--run", "runs/a", "--out", "hf"]).run == "runs/a"
  assert cli._parse(["export", "runs/a", "--run", "runs/a", "--out", "hf"]).run == "runs/a"
  for argv in (["export", "--out", "hf"], ["export", "a", "--run", "b", "--out", "hf"]):
    with pytest.raises(SystemExit):
      cli._parse(argv)


def test_plan_devices_per_node_defaults_to_eight(capsys):
  main(["plan", "--model", "tiny", "--nodes", "2", "--json"])
  assert json.loads(capsys.readouterr().out)["inputs"]["devices_per_node"] == 8
  help_text = " ".join(
    cli.build_parser()._subparsers._group_actions[0].choices["plan"].format_help().split()
  )
  assert "--devices-per-node DEVICES_PER_NODE M: devices per node (default 8)" in help_text


def test_plan_profile_memory_is_the_probed_devices(tmp_path, capsys):
  """A CPU probe's devices have the host's memory, not the default --gpu's 80 GB; --device-memory
  still wins."""
  path = tmp_path / "probe.json"
  path.write_text(json.dumps({"collectives": {}, "device_memory": 3 * 2**30}))
  plan = ["plan", "--model", "tiny", "--nodes", "2", "--profile", str(path)]
  main([*plan, "--json"])
  assert json.loads(capsys.readouterr().out)["inputs"]["device_memory_bytes"] == 3 * 2**30
  main(plan)
  assert "devices of 3.2 GB (profile)" in capsys.readouterr().out
  main([*plan, "--device-memory", "40GB", "--json"])
  assert json.loads(capsys.readouterr().out)["inputs"]["device_memory_bytes"] == 40e9


def test_plan_shows_small_models_in_small_units(capsys):
  main(["plan", "--model", "tiny", "--nodes", "2"])
  out = capsys.readouterr().out
  assert out.startswith("tiny (1.05M params) on 2 nodes x 8 devices")
  assert "0.00" not in out.splitlines()[0]


def _fresh(code: str, env=None) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
  )


def test_plan_imports_no_jax():
  proc = _fresh(
    "import sys\n"
    "from paro_jax.cli import main\n"
    "main(['plan', '--model', '7b', '--nodes', '2'])\n"
    "main(['plan', '--model', 'tiny', '--nodes', '2', '--json'])\n"
    "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')], "
    "sorted(m for m in sys.modules if m.startswith(('jax', 'flax')))[:5]\n"
  )
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]


def _cuda_plugin_without_driver() -> bool:
  import importlib.util

  try:
    plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    plugin = False
  return plugin and not any(
    os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl")
  )


@pytest.mark.skipif(
  not _cuda_plugin_without_driver(),
  reason="needs JAX's CUDA plugin installed on a machine without an NVIDIA driver",
)
def test_no_driver_no_cuda_probe_one_line(tmp_path):
  """With the plugin but no driver, a run starting jax prints no cudart_stub lines: its stderr
  is the one error line; the platform note is on stdout."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  argv = [*TRAIN, "--mesh", "2x4", "--attention", "cudnn", "--out", str(tmp_path / "r")]
  proc = _fresh(f"from paro_jax.cli import main; main({argv!r})", env=env)
  assert proc.returncode == 2
  assert proc.stderr.splitlines() == [
    "paro-jax: error: --attention cudnn needs NVIDIA GPUs (this run is on cpu); use --attention xla"
  ], proc.stderr[-3000:]
  assert "without probing JAX's CUDA plugin" in proc.stdout


def test_launch_folds_gloo_chatter_and_tracebacks():
  """A node's [Gloo] lines and Python tracebacks stay out of the terminal (in the launcher's
  log); its other lines pass, and the failure message's tail keeps the whole stderr."""
  import threading

  from paro_jax.cluster.supervise import Node

  script = (
    "import sys\n"
    "print('[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
    "ranks is : 1')\n"
    "print('step 1')\n"
    "sys.stderr.write('Traceback (most recent call last):\\n  File \"x.py\", line 1\\n'\n"
    "  'RuntimeError: Gloo connection closed by peer\\n\\nDuring handling of the above "
    "exception, another exception occurred:\\n\\nTraceback (most recent call last):\\n'\n"
    "  '  File \"y.py\", line 2\\nValueError: second\\nafter it\\n')\n"
  )
  for show_gloo in (False, True):
    out, err = io.StringIO(), io.StringIO()
    proc = subprocess.Popen(
      [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    node = Node(3, proc, out, err, threading.Lock(), show_gloo)
    proc.wait()
    node.join()
    gloo = "[node 3] [Gloo] Rank 0 is connected to 1 peer ranks."
    assert out.getvalue().startswith(gloo) == show_gloo, out.getvalue()
    assert "[node 3] step 1\n" in out.getvalue()
    assert err.getvalue() == "[node 3] after it\n", err.getvalue()
    assert list(node.tail)[-1] == "after it" and "ValueError: second" in node.tail


def test_each_process_and_command_has_its_log(monkeypatch):
  monkeypatch.delenv("SLURM_PROCID", raising=False)
  monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
  place = lambda argv, child=(): cli._log_place(cli._parse(argv), list(child))
  assert place(["train", "--out", "r"]) == ("r", "paro-jax.log")
  assert place(["train", "--out", "r", "--process-id", "2"]) == ("r", "paro-jax.node2.log")
  monkeypatch.setenv("SLURM_PROCID", "3")
  assert place(["train", "--out", "r"]) == ("r", "paro-jax.node3.log")
  # export joins a multi-process job too: a log per process in the run directory it reads
  assert place(["export", "r", "--out", "hf"]) == ("r", "paro-jax.node3.log")
  assert place(["export", "r", "--out", "hf", "--process-id", "0"]) == ("r", "paro-jax.log")
  launch = ["launch", "--nodes", "2", "--devices-per-node", "2"]
  assert place(launch, ["train", "--out", "r"]) == ("r", "paro-jax.launch.log")
  assert place(["plan", "--nodes", "2"]) == (None, "paro-jax.log")


@pytest.mark.parametrize("thread", [False, True])
def test_an_uncaught_full_disk_error_is_never_silent(tmp_path, thread):
  """A full disk under a library's frames is known noise in the writer threads (the run says
  what it means), but one that ends the program is one error line naming the log: it exited 1
  printing nothing (an export on a full disk did)."""
  code = (
    "import errno, threading\n"
    "from paro_jax import report\n"
    f"report.install(); report.set_log_dir({str(tmp_path)!r})\n"
    "def fail():\n"
    "  raise OSError(errno.ENOSPC, 'No space left on device')\n"
    + ("t = threading.Thread(target=fail); t.start(); t.join()\n" if thread else "fail()\n")
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert "Traceback" not in done.stderr
  log = open(tmp_path / "paro-jax.log").read()
  assert "No space left on device" in log and "Traceback" in log
  if thread:  # the thread's failure is the main thread's to report: nothing here, exit 0
    assert done.returncode == 0 and done.stderr == ""
  else:
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
      f"paro-jax: error: OSError: [Errno 28] No space left on device (the traceback is in "
      f"{tmp_path / 'paro-jax.log'})"
    ]
