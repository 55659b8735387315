"""What a newcomer meets first: --help, a script uploaded without common.py or a package it needs, run_local.sh's
flags and installs."""
import gzip
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run, run_script, script_env


@pytest.mark.parametrize('script, start_command, modules', [
    ('mnist_train.py', 'python /mnt/data/mnist_train.py', 'common.py and review.py'),
    ('mnist_train_distributed.py', 'torchrun --nproc_per_node=1 --nnodes=${WORLD_SIZE} --node_rank=${RANK}',
     'common.py, peers.py and review.py'),
])
def test_help_shows_the_dlc_start_command_and_the_output(script, start_command, modules):
    _, stdout, _ = run_script([sys.executable, ROOT / script, '--help'])
    assert start_command in stdout
    assert 'best_model.pth' in stdout and 'checkpoint.pth' in stdout and 'runs/mnist_experiment' in stdout
    assert f'upload {modules} beside this script' in ' '.join(stdout.split())
    assert 'counting those done before a restart' in stdout  # --epochs is a total


@pytest.mark.one_leg  # torch-independent: the import's error
@pytest.mark.parametrize('script, beside, missing', [
    ('mnist_train.py', [], 'common.py'), ('mnist_train.py', ['common.py'], 'review.py'),
    ('mnist_train_distributed.py', [], 'common.py'), ('mnist_train_distributed.py', ['common.py'], 'peers.py'),
    ('mnist_train_distributed.py', ['common.py', 'peers.py'], 'review.py'),
    ('serve.py', [], 'common.py'), ('serve.py', ['common.py'], 'framing.py'),
    ('serve.py', ['common.py', 'framing.py'], 'asgi.py'),
])
def test_a_script_uploaded_without_a_module_it_imports_says_so_in_one_line(script, beside, missing, tmp_path):
    for name in (script, *beside):
        shutil.copy(ROOT / name, tmp_path / name)
    returncode, stdout, stderr = run([sys.executable, tmp_path / script], check=False,
                                     env=script_env(PYTHONPATH=''))
    assert returncode == 1, stderr
    assert stderr == f'error: {missing} is missing: upload it beside {tmp_path / script} (on DLC, to the same ' \
                     f'folder of the dataset as the script).\n'


@pytest.mark.one_leg  # the import's error, the same on either torch
@pytest.mark.parametrize('package', ['torch', 'uvicorn', 'gunicorn', 'uvicorn_worker'])
def test_serve_py_without_a_package_it_needs_says_what_to_install(package, tmp_path):
    """As on an image without the serving packages (the EAS run command's pip install left out)."""
    (tmp_path / package).mkdir()  # found first on the path: a package that is not installed
    (tmp_path / package / '__init__.py').write_text(
        f'raise ModuleNotFoundError("No module named {package!r}", name={package!r})\n')
    returncode, _, stderr = run([sys.executable, ROOT / 'serve.py', '--help'], check=False,
                                env=script_env(PYTHONPATH=str(tmp_path)))
    assert returncode == 1, stderr
    assert stderr == f'error: serve.py needs {package}: pip install -r {ROOT / "requirements-serve.txt"} ' \
                     f'(./run_local.sh serve installs it).\n'


@pytest.mark.one_leg('newest')
@pytest.mark.slow
def test_run_local_gives_each_script_only_the_flags_it_takes(mnist_dir, tmp_path):
    venv = Path(sys.executable).parent.parent
    if not list(venv.glob('.installed-*')):
        pytest.skip('not in an environment made by run_local.sh')
    out = tmp_path / 'out'
    returncode, stdout, stderr = run(['bash', ROOT / 'run_local.sh', '--epochs', '1', '--data-dir', mnist_dir,
                                      '--output-dir', out, '--batch-size', '16', '--log-interval', '10',
                                      '--backend', 'gloo', '--join-timeout=120'],
                                     env=script_env(VENV=str(venv)), timeout=300)
    # The single script would have stopped at --backend ("unrecognized arguments").
    assert 'unrecognized arguments' not in stderr
    assert re.search(r'^Train Epoch: 0 \[0/640', stdout, re.M), 'the single script ran'
    assert 'with gloo' in stdout and 'waiting up to 120s for all ranks' in stdout  # both reached it
    assert sorted(p.name for p in out.iterdir()) == ['distributed', 'single']
    for name in ('single', 'distributed'):
        assert (out / name / 'best_model.pth').exists()
    assert f'Models:      {out}/single/best_model.pth, {out}/distributed/best_model.pth' in stdout


def left_in(temporary_folder):
    """What runs left in their temporary folder, torch's compiler cache aside (one folder, reused by every run)."""
    return sorted(path.name for path in temporary_folder.iterdir() if not path.name.startswith('torchinductor_'))


@pytest.mark.one_leg
@pytest.mark.slow
def test_the_benchmarks_run_print_their_figures_and_leave_no_temporary_files(mnist_dir, tmp_path):
    # Speed is not asserted here (that belongs to the benchmarks themselves): only that they still run.
    scratch, gzipped = tmp_path / 'tmp', tmp_path / 'gz' / 'MNIST' / 'raw'
    scratch.mkdir()
    env = script_env(TMPDIR=str(scratch))
    _, stdout, _ = run([sys.executable, ROOT / 'tests' / 'benchmark.py', '--data-dir', mnist_dir, '--repeats', '1'],
                       env=env)
    assert re.search(r'^ours / document +\d+\.\d{3} ', stdout, re.M) and 'peak RSS' in stdout
    gzipped.mkdir(parents=True)  # MNIST as downloaded by hand, the .gz files alone: read as the scripts read them
    for file in (mnist_dir / 'MNIST' / 'raw').iterdir():
        (gzipped / f'{file.name}.gz').write_bytes(gzip.compress(file.read_bytes()))
    _, stdout, _ = run([sys.executable, ROOT / 'tests' / 'bench_serve.py', '--data-dir', tmp_path / 'gz',
                        '--requests', '40', '--rounds', '1', '--workers', '1'], env=env)
    assert re.search(r'latency p50 \d+\.\d\d ms', stdout) and re.search(r'\d+ requests/s', stdout)
    assert 'serve.py --workers 1,' in stdout and ' with 1 worker process: ' in stdout  # the flag passed on
    assert left_in(scratch) == []  # the TensorBoard events timed, the freshly initialised model served: removed


@pytest.mark.one_leg
def test_a_benchmark_server_that_does_not_start_says_why(tmp_path, monkeypatch):
    """bench_serve.py's servers (a baseline revision's serve.py among them) keep the caller's PYTHONPATH, and one
    that does not start ends the benchmark with what it said (it once failed with a bare AssertionError)."""
    from bench_serve import Server
    (tmp_path / 'site').mkdir()
    (tmp_path / 'site' / 'found_on_the_path.py').write_text('')
    script = tmp_path / 'serve.py'
    script.write_text('import sys\nimport found_on_the_path\nsys.exit("error: serve.py needs httptools")\n')
    monkeypatch.setenv('PYTHONPATH', str(tmp_path / 'site'))
    with pytest.raises(SystemExit) as stop:
        Server(str(script), 'model.pth')
    assert str(stop.value) == f'{script} did not start: error: serve.py needs httptools'


# A stand-in for python3 and for the environment's python: it writes each command line it is given to $CALLS,
# makes an environment as `-m venv [--clear] FOLDER` (a copy of itself), answers run_local.sh's question of its
# version as Python 3.11.7 would, and says "no GPU" to its torch question.
FAKE_PYTHON = '''#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [ "$1 $2" = "-m venv" ]; then
    folder=${!#}
    if [ "$3" = --clear ]; then rm -rf "$folder"; fi
    mkdir -p "$folder/bin" && cp "$0" "$folder/bin/python"
fi
if [ "$1" = -c ]; then
    case "$2" in *version_info*) "%s" -c "import sys; sys.version_info = (3, 11, 7); exec(sys.argv[1])" "$2";;
        *) echo 0;; esac
fi
''' % sys.executable
NEEDS = {  # what each command must find installed in its environment, whatever ran before it
    'run': ['-r requirements.txt'],
    'serve': ['-r requirements.txt -r requirements-serve.txt'],
    'test': ['-r requirements-test.txt'],
    'bench': ['-r requirements.txt'],
    'bench-serve': ['-r requirements.txt -r requirements-serve.txt httptools'],  # httptools: the baseline's parser
    'bench-digits': ['-r requirements.txt -r requirements-serve.txt httptools'],
}


@pytest.mark.parametrize('order', [('run', 'serve', 'test'), ('test', 'serve', 'run'), ('serve', 'run', 'bench'),
                                   ('run', 'run', 'serve', 'serve'), ('serve', 'bench-serve', 'bench-digits', 'test')])
def test_each_run_local_command_installs_what_it_needs_whatever_ran_before(order, tmp_path):
    fake = tmp_path / 'python3'
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls, installed = tmp_path / 'calls', []
    env = script_env(PYTHON=str(fake), VENV=str(tmp_path / 'venv'), CALLS=str(calls))
    for command in order:
        calls.write_text('')
        run(['bash', ROOT / 'run_local.sh', *([] if command == 'run' else [command])], env=env, timeout=60)
        installs = [line.split('--disable-pip-version-check ')[1] for line in calls.read_text().splitlines()
                    if line.startswith('-m pip install')]
        assert all(need in installed + installs for need in NEEDS[command]), (command, installed, installs)
        assert not set(installs) & set(installed), f'{command} installed a set again: {installs}'
        installed += installs
        assert any(line.startswith(('mnist_train', 'serve.py', '-m pytest', 'tests/bench'))
                   for line in calls.read_text().splitlines()), f'{command} ran nothing'


def test_run_local_makes_an_environment_whose_python_is_gone_anew(tmp_path):
    fake, calls, folder = tmp_path / 'python3', tmp_path / 'calls', tmp_path / 'venv'
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = script_env(PYTHON=str(fake), VENV=str(folder), CALLS=str(calls))
    run(['bash', ROOT / 'run_local.sh', 'test'], env=env, timeout=60)
    (folder / 'bin' / 'python').unlink()  # the Python it was made with, upgraded away
    (folder / 'bin' / 'python').symlink_to(tmp_path / 'python3.12')
    (folder / 'pyvenv.cfg').write_text('home = /opt/homebrew/opt/python@3.12/bin\n')
    calls.write_text('')
    returncode, _, stderr = run(['bash', ROOT / 'run_local.sh', 'test'], env=env, check=False, timeout=60)
    assert returncode == 0 and stderr == (f'run_local.sh: {folder} cannot run: its Python (from /opt/homebrew/opt/'
                                          f'python@3.12/bin) is gone (upgraded or removed?); making {folder} anew\n')
    lines = calls.read_text().splitlines()
    assert lines[0] == f'-m venv --clear {folder}' and lines[-1].startswith('-m pytest'), lines
    assert any(line.startswith('-m pip install') for line in lines), lines
    other = tmp_path / 'other'  # a folder that is no environment of run_local.sh's, named by mistake: kept
    (other / 'bin').mkdir(parents=True)
    (other / 'pyvenv.cfg').write_text('home = /gone/bin\n')
    run(['bash', ROOT / 'run_local.sh', 'test'], env={**env, 'VENV': str(other)}, check=False, timeout=60)
    assert (other / 'pyvenv.cfg').read_text() == 'home = /gone/bin\n'


def fake_python_of_version(path, version):
    """FAKE_PYTHON at path, answering run_local.sh's question of its version by running its code as that version."""
    path.write_text(FAKE_PYTHON.replace('(3, 11, 7)', repr(version)))
    path.chmod(0o755)


@pytest.mark.parametrize('command', [['test-pai'], ['gpu-check', '--pai']])
def test_run_local_says_which_pythons_pais_torch_takes_before_installing_it(command, tmp_path):
    fake = tmp_path / 'python3'
    calls, folder = tmp_path / 'calls', tmp_path / 'venv-pai'
    env = script_env(PYTHON=str(fake), VENV=str(tmp_path / 'venv'), VENV_PAI=str(folder), CALLS=str(calls))
    # torch 2.3.1 has no wheels for 3.13; on 3.12 its torchrun crashes now and then (pytorch/pytorch#125990)
    for version in ((3, 13, 0), (3, 12, 1)):
        fake_python_of_version(fake, version)
        returncode, stdout, stderr = run(['bash', ROOT / 'run_local.sh', *command], env=env, check=False, timeout=60)
        assert returncode == 2 and stdout == '' and stderr == (
            f"run_local.sh: PAI's torch 2.3.1 needs Python 3.10 or 3.11, not {version[0]}.{version[1]} ({fake}): it "
            f"has no wheels for 3.13 or newer, and on 3.12 its torchrun crashes (exit -11, pytorch/pytorch#125990): "
            f"run again with PYTHON naming a Python 3.10 or 3.11 (PYTHON=python3.11 ./run_local.sh ...).\n")
        assert not folder.exists() and 'pip' not in calls.read_text()
    (folder / 'bin').mkdir(parents=True)  # an environment made with it before: to be removed first
    shutil.copy(fake, folder / 'bin' / 'python')
    stderr = run(['bash', ROOT / 'run_local.sh', *command], env=env, check=False, timeout=60)[2]
    assert stderr.startswith(f"run_local.sh: PAI's torch 2.3.1 needs Python 3.10 or 3.11, not 3.12 "
                             f"({folder}/bin/python): it has"), stderr
    assert f'rm -rf {folder}, then run again with PYTHON naming' in stderr, stderr
    run(['bash', ROOT / 'run_local.sh', 'test'], env=env, timeout=60)  # the newest torch's leg takes it
    assert '-m pip install' in calls.read_text() and '-m pytest' in calls.read_text()
    fake_python_of_version(fake, (3, 11, 7))  # PAI's image's Python, the newest torch 2.3.1 runs well on
    shutil.rmtree(folder)
    calls.write_text('')
    run(['bash', ROOT / 'run_local.sh', *command], env=env, timeout=60)
    assert any(line.startswith('-m pip install') and 'constraints-pai.txt' in line
               for line in calls.read_text().splitlines()), calls.read_text()


@pytest.mark.parametrize('command', [[], ['serve'], ['test']])
def test_run_local_refuses_a_python_older_than_3_10_before_installing(command, tmp_path):
    fake = tmp_path / 'python3'
    fake_python_of_version(fake, (3, 9, 6))  # past its end of life: pip would install torch 2.8, untested here
    calls, folder = tmp_path / 'calls', tmp_path / 'venv'
    env = script_env(PYTHON=str(fake), VENV=str(folder), CALLS=str(calls))
    returncode, stdout, stderr = run(['bash', ROOT / 'run_local.sh', *command], env=env, check=False, timeout=60)
    assert returncode == 2 and stdout == '' and stderr == (
        f'run_local.sh: these scripts need Python 3.10 or newer, not 3.9 ({fake}): run again with PYTHON naming a '
        f'Python 3.10 to 3.13 (PYTHON=python3.11 ./run_local.sh ...).\n')
    assert not folder.exists() and 'pip' not in calls.read_text()
    fake_python_of_version(fake, (3, 10, 0))  # the oldest taken
    run(['bash', ROOT / 'run_local.sh', *command], env=env, timeout=60)
    assert '-m pip install' in calls.read_text()


@pytest.mark.parametrize('system, check', [('Darwin', 'YES'), ('Linux', '')])
def test_run_local_serve_turns_objective_c_fork_check_off_on_macos_only(system, check, tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('python3', FAKE_PYTHON + 'echo "objc check off: ${OBJC_DISABLE_INITIALIZE_FORK_SAFETY:-}" '
                                                 '>> "$CALLS"\n'), ('uname', f'#!/bin/sh\necho {system}\n')):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / 'calls'
    env = script_env(PYTHON=str(bin_dir / 'python3'), VENV=str(tmp_path / 'venv'), CALLS=str(calls),
                     PATH=f'{bin_dir}:{os.environ["PATH"]}')
    run(['bash', ROOT / 'run_local.sh', 'serve'], env=env, timeout=60)
    lines = calls.read_text().splitlines()
    served = next(k for k, line in enumerate(lines) if line.startswith('serve.py'))
    assert lines[served + 1] == f'objc check off: {check}', lines


@pytest.mark.parametrize('command', [[], ['serve'], ['test']])
def test_run_local_in_git_bash_says_how_to_run_on_windows_and_makes_nothing(command, tmp_path):
    # Windows' Python makes a venv with Scripts\python.exe, not bin/python: before, "bin/python: No such file"
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('uname', '#!/bin/sh\necho MINGW64_NT-10.0-19045\n'), ('python3', FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / 'calls'
    calls.touch()
    env = script_env(PYTHON=str(bin_dir / 'python3'), VENV=str(tmp_path / 'venv'), CALLS=str(calls),
                     PATH=f'{bin_dir}:{os.environ["PATH"]}')
    returncode, stdout, stderr = run(['bash', ROOT / 'run_local.sh', *command], env=env, check=False, timeout=60)
    assert returncode == 2 and stdout == '' and stderr == (
        'run_local.sh: it runs on Linux and macOS, and on Windows under WSL; elsewhere on Windows, run the scripts '
        'by hand as README.md\'s "On Windows" shows.\n')
    assert not (tmp_path / 'venv').exists() and calls.read_text() == ''  # no venv made, nothing installed or run
    readme = ' '.join((ROOT / 'README.md').read_text().split())
    assert 'On Windows, run `./run_local.sh` under WSL, where it is Linux (in Git Bash it says so and stops)' in readme


@pytest.mark.one_leg
@pytest.mark.slow
def test_gpu_check_runs_every_check_on_the_cpu_and_fails_for_a_failed_one(mnist_big_dir, tmp_path):
    # CI has no GPU: the same command on the CPU checks its own logic, one epoch a run. A bar no run reaches (101%)
    # makes the single script's check fail, and so the command; every other check still runs and passes.
    out, temporary = tmp_path / 'out', tmp_path / 'tmp'
    temporary.mkdir()
    env = script_env(TMPDIR=str(temporary))
    returncode, stdout, _ = run([sys.executable, ROOT / 'tests' / 'gpu_check.py', '--device', 'cpu', '--data-dir',
                                 mnist_big_dir, '--epochs', '1', '--min-accuracy', '101', '--output-dir', out,
                                 '--join-timeout', '120'], check=False, timeout=600, env=env)
    checks = dict(re.findall(r'^check (\w+): (ok|FAILED|skipped): ', stdout, re.M))
    assert checks == {'single': 'FAILED', 'placement': 'skipped', 'standalone': 'ok', 'static': 'ok',
                      'restart': 'ok', 'serve': 'ok', 'review': 'ok'}, stdout
    assert re.search(r'^check single: FAILED: best \d+\.\d\d% \(bar 101\.0%\), \d+\.\d\ds an epoch; one epoch, ours / '
                     r'the document\'s pipeline: \d\.\d{3}$', stdout, re.M), stdout
    assert 'check placement: skipped: CUDA only' in stdout
    assert re.search(r'^check standalone: ok: 2 processes, 1 validations of 200 images', stdout, re.M)
    assert re.search(r'^check serve: ok: 20 test digits: 20/20 as on cpu', stdout, re.M)
    assert stdout.splitlines()[-1] == 'gpu-check: 5 passed, 1 failed, 1 skipped' and returncode == 1
    assert left_in(temporary) == []  # the digits served and torchrun's folders are in the output folder


@pytest.mark.one_leg  # which files the scripts import does not depend on torch's version
def test_the_top_level_py_files_are_all_that_a_dlc_job_needs(mnist_dir, tmp_path):
    """README's upload list, copied alone into an empty folder as into DLC's dataset mount; both start commands
    run from there, with nothing of the repository on the path."""
    from conftest import free_port, torchrun
    mount = tmp_path / 'mnt_data'
    mount.mkdir()
    for path in ROOT.glob('*.py'):
        shutil.copy(path, mount)
    env = script_env(PYTHONPATH='')
    fast = ('--data-dir', mnist_dir, '--epochs', '1', '--batch-size', '64', '--log-interval', '5')
    run([sys.executable, mount / 'mnist_train.py', *fast, '--output-dir', tmp_path / 'single'], env=env)
    run(torchrun('--nproc_per_node=1', '--nnodes=1', '--node_rank=0', '--master_addr=127.0.0.1',
                 f'--master_port={free_port()}', mount / 'mnist_train_distributed.py', *fast,
                 '--output-dir', tmp_path / 'distributed'), env=env)
    for name in ('single', 'distributed'):
        assert (tmp_path / name / 'best_model.pth').exists()
