"""mnist_train_distributed.py under torchrun on CPU with gloo, as DLC runs it, on one machine.

Each test here fails on the document's version of the script: it needs CUDA and NCCL, every rank
validates the whole test set (the total printed is world_size * 200), and only global rank 0
downloads the data (a second node with its own disk has none).
"""
import os
import re
import signal
import socket
import time

import pytest
import torch

import common
from conftest import (ROOT, FILES, Mirror, dist_cmd, event_writers, free_port, gz_files, in_tmp, read_scalars, run,
                      run_script, script_env, start, torchrun, torchrun_report)

FAST = ('--lr', '0.1', '--batch-size', '16', '--log-interval', '5')
SCRIPT = ROOT / 'mnist_train_distributed.py'


def check_result(stdout, out, epochs, world_size):
    """What every finished run must show: exact validation, one plain checkpoint, logs by rank 0."""
    totals = re.findall(r'^Validation Loss: \d+\.\d{4}, Accuracy: \d+/(\d+) \(\d+%\)$', stdout, re.M)
    assert totals == ['200'] * epochs, 'each sample validated once per epoch, whatever the world size'
    for rank in range(world_size):
        assert f'Rank: {rank}, Local_Rank: 0 -- Train Epoch: 0 [0/640 (0%)]' in stdout \
            or f'Rank: {rank}, Local_Rank: {rank} -- Train Epoch: 0 [0/640 (0%)]' in stdout
    assert stdout.count('Training complete. writer.close()') == 1
    state = torch.load(out / 'best_model.pth', weights_only=True)
    assert not any(key.startswith('module.') for key in state)
    common.SimpleCNN().load_state_dict(state)
    assert sorted(p.name for p in out.iterdir()) == ['best_model.pth', 'checkpoint.pth', 'runs']
    assert len(event_writers(out / 'runs' / 'mnist_experiment')) == 1, 'one writer: rank 0'
    assert [s for s, _ in read_scalars(out / 'runs' / 'mnist_experiment')['Accuracy/validation']] == list(range(epochs))
    # The best model's review counts every test image once, whatever the world size: as printed.
    from test_single import check_review
    best = max(int(c) for c in re.findall(r'^Validation Loss: \d+\.\d{4}, Accuracy: (\d+)/200', stdout, re.M))
    check_review(out, best_correct=best, total=200, step=epochs)


def test_two_processes_on_one_node(mnist_dir, tmp_path):
    out = tmp_path / 'out'
    # The largest timeouts the flags take: they become timedeltas and timeouts of torch's store, within the limits
    # of both (1e20 s crashed: a timedelta holds at most 8.64e13 s)
    most = str(common.MAX_SECONDS)
    _, stdout, _ = run(torchrun('--standalone', '--nproc_per_node=2', SCRIPT, '--data-dir', mnist_dir,
                                '--output-dir', out, '--epochs', '2', '--join-timeout', most,
                                '--collective-timeout', most, *FAST))
    check_result(stdout, out, epochs=2, world_size=2)
    assert 'as rank 1 of 2 (waiting up to 1000000000s for all ranks)' in stdout
    assert '[320/640 (50%)]' in stdout  # batch 10 of 20 per rank: 10 * 16 * 2 samples seen
    accuracy = float(re.findall(r'Model saved with accuracy: (\d+\.\d+)%', stdout)[-1])
    assert accuracy > 50


def test_without_torchrun_runs_as_a_world_of_one(mnist_dir, tmp_path):
    out = tmp_path / 'out'
    # A MASTER_ADDR and MASTER_PORT left in the environment by something else do not make a job.
    _, stdout, _ = run_script(dist_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST),
                              env=script_env(MASTER_ADDR='10.0.0.1', MASTER_PORT='29500'))
    assert stdout.startswith('Not started by torchrun')
    assert 'Rank 0/1 (local rank 0' in stdout
    check_result(stdout, out, epochs=1, world_size=1)
    _, stdout, _ = run_script(dist_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST))
    assert 'Training already complete' in stdout and 'Train Epoch' not in stdout


@pytest.fixture
def mirror(mnist_dir):
    mirror = Mirror(gz_files(mnist_dir))
    yield mirror
    mirror.close()


def two_nodes(data_dirs, out, env, epochs=1):
    """Two torchrun launchers, one process each, as DLC starts a 2-node job; returns their outputs."""
    port = free_port()
    nodes = [start(torchrun('--nproc_per_node=1', '--nnodes=2', f'--node_rank={node}',
                            '--master_addr=127.0.0.1', f'--master_port={port}', SCRIPT,
                            '--data-dir', data_dirs[node], '--output-dir', out, '--epochs', str(epochs), *FAST),
                   env=env) for node in (0, 1)]
    outputs = [reader.rest(timeout=180) for _, reader in nodes]
    return [proc.returncode for proc, _ in nodes], outputs


def test_two_nodes_with_a_shared_data_mount_download_once(mirror, tmp_path):
    shared = tmp_path / 'shared_mount'
    env = script_env(MNIST_MIRROR=mirror.url, no_proxy='127.0.0.1')
    codes, outputs = two_nodes([shared, shared], tmp_path / 'out', env)
    assert codes == [0, 0], outputs
    check_result(''.join(outputs), tmp_path / 'out', epochs=1, world_size=2)
    assert mirror.downloads() == {name: 1 for name in FILES}, 'one download of each file'
    assert sorted(p.name for p in (shared / 'MNIST' / 'raw').iterdir()) == sorted(FILES)


def test_two_nodes_with_local_disks_each_get_the_data(mirror, tmp_path):
    node_disks = [tmp_path / 'node0', tmp_path / 'node1']
    env = script_env(MNIST_MIRROR=mirror.url, no_proxy='127.0.0.1')
    codes, outputs = two_nodes(node_disks, tmp_path / 'out', env)
    assert codes == [0, 0], outputs
    check_result(''.join(outputs), tmp_path / 'out', epochs=1, world_size=2)
    assert mirror.downloads() == {name: 2 for name in FILES}, 'each node downloads its own copy'
    for disk in node_disks:
        assert sorted(p.name for p in (disk / 'MNIST' / 'raw').iterdir()) == sorted(FILES)


@pytest.mark.slow
def test_a_download_slower_than_the_collective_timeout_is_no_lost_peer(mnist_dir, tmp_path):
    # The other ranks wait for rank 0's download through the store, not a collective: a 1 s collective timeout
    # does not end a download of several seconds (under NCCL, the watchdog's 10 minutes would not either).
    slow = Mirror(gz_files(mnist_dir), delay=0.01)  # 2 KiB each 10 ms: about 4 s for the four files
    try:
        out, port = tmp_path / 'out', free_port()
        proc, reader = start(torchrun('--nnodes=1', '--node_rank=0', '--master_addr=127.0.0.1',
                                      f'--master_port={port}', '--nproc_per_node=2', SCRIPT, '--data-dir',
                                      tmp_path / 'data', '--output-dir', out, '--epochs', '1', '--collective-timeout',
                                      '1', *FAST), env=script_env(MNIST_MIRROR=slow.url, no_proxy='127.0.0.1'))
        output = reader.rest(timeout=180)
        assert proc.returncode == 0, output
        assert slow.downloads() == {name: 1 for name in FILES}
        check_result(output, out, epochs=1, world_size=2)
    finally:
        slow.close()


def test_a_node_without_data_stops_every_rank_with_the_reason(mnist_dir, tmp_path):
    offline = script_env(http_proxy='http://127.0.0.1:9', https_proxy='http://127.0.0.1:9', no_proxy='')
    codes, outputs = two_nodes([mnist_dir, tmp_path / 'empty_disk'], tmp_path / 'out', offline)
    assert codes[0] != 0 and codes[1] != 0
    # torchrun's failure report on each node: the rank where it began, its paragraph as the cause.
    rank, message = torchrun_report(outputs[1])['root']
    assert rank == 1 and message.startswith(f'error: MNIST is not in {tmp_path}/empty_disk/MNIST/raw'), outputs[1]
    assert torchrun_report(outputs[0])['root'] == (
        0, f"error: stopped because rank 1 ({socket.gethostname()}) failed during set-up (the root cause: see its "
           f"node's report)"), outputs[0]
    for output in outputs:  # the paragraph once, in the report: no traceback of ours
        assert output.count('MNIST is not in') <= 1 and not re.search(r'File ".*mnist_train_distributed\.py"', output)
    assert not (tmp_path / 'out' / 'checkpoint.pth').exists()


@pytest.mark.slow
def test_a_refused_resume_is_the_root_cause_in_torchruns_report(mnist_dir, tmp_path):
    out = tmp_path / 'out'
    run_script(dist_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST))  # lr 0.1
    port = free_port()
    nodes = [start(torchrun('--nproc_per_node=1', '--nnodes=2', f'--node_rank={node}', '--master_addr=127.0.0.1',
                            f'--master_port={port}', SCRIPT, '--data-dir', mnist_dir, '--output-dir', out,
                            '--epochs', '2', '--lr', '0.05', '--batch-size', '16')) for node in (0, 1)]
    outputs = [reader.rest(timeout=180) for _, reader in nodes]
    rank, message = torchrun_report(outputs[0])['root']
    assert rank == 0 and message.startswith(f'error: {out}/checkpoint.pth was trained with --lr 0.1 (now 0.05); '
                                            f'resuming would mix'), outputs[0]
    assert torchrun_report(outputs[1])['root'] == (
        1, f"error: stopped because rank 0 ({socket.gethostname()}) failed during set-up (the root cause: see its "
           f"node's report)"), outputs[1]
    assert outputs[0].count('was trained with') == 1, 'the paragraph once'


def test_a_lost_peer_is_the_survivors_paragraph_in_torchruns_report(mnist_big_dir, tmp_path):
    port = free_port()
    nodes = [start(torchrun('--nproc_per_node=1', '--nnodes=2', f'--node_rank={node}', '--master_addr=127.0.0.1',
                            f'--master_port={port}', SCRIPT, '--data-dir', mnist_big_dir, '--output-dir',
                            tmp_path / 'out', '--epochs', '2', '--log-interval', '20')) for node in (0, 1)]
    readers = [reader for _, reader in nodes]
    pid = int(wait_in(readers, r'^Rank 1/2 \(local rank 0, pid (\d+)\)').group(1))
    wait_in(readers, r'^Rank: 1, Local_Rank: 0 -- Train Epoch: 0 \[2560/')
    os.kill(pid, signal.SIGKILL)  # node 1's worker gone, no restarts
    outputs = [reader.rest(timeout=240) for reader in readers]
    rank, message = torchrun_report(outputs[0])['root']
    assert rank == 0 and re.match(r'error: rank 0 lost rank 1 of 2 during epoch 0 \(.*\): its process or node is '
                                  r'gone\.', message), outputs[0]
    assert torchrun_report(outputs[1])['root'][0] == 1 and 'Signal 9 (SIGKILL)' in outputs[1]
    assert outputs[0].count('lost rank 1') == 1 and not re.search(r'File ".*mnist_train_distributed\.py"', outputs[0])


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_resumes(mnist_big_dir, tmp_path):
    out = tmp_path / 'out'
    # DLC's static rendezvous (--standalone restarts hit a bug of torch 2.3's elastic agent).
    proc, reader = start(torchrun('--nnodes=1', '--node_rank=0', '--master_addr=127.0.0.1',
                                  f'--master_port={free_port()}', '--nproc_per_node=2', '--max-restarts=1', SCRIPT,
                                  '--data-dir', mnist_big_dir, '--output-dir', out, '--epochs', '3',
                                  '--log-interval', '20'))
    rank1 = reader.wait_for(lambda line: line.startswith('Rank 1/2'))
    pid = int(re.search(r'pid (\d+)', rank1).group(1))
    reader.wait_for(lambda line: line.startswith('Rank: 1, Local_Rank: 1 -- Train Epoch: 1 [0/'))
    # Freeze rank 1 mid-epoch (rank 0 cannot finish the epoch without it), check, then kill it.
    os.kill(pid, signal.SIGSTOP)
    assert 'Epoch 1 done' not in reader.drain(), 'the kill came after epoch 1 ended'
    os.kill(pid, signal.SIGKILL)
    output = reader.rest(timeout=240)
    assert proc.returncode == 0, output

    before, resumed, after = output.partition('Resuming from epoch 1 ')
    assert resumed, output
    assert re.findall(r'^Epoch (\d) done', before, re.M) == ['0']
    assert re.findall(r'^Epoch (\d) done', after, re.M) == ['1', '2']
    assert len(re.findall(r'^Validation Loss', after, re.M)) == 2, 'each epoch after the resume validated once'
    scalars = read_scalars(out / 'runs' / 'mnist_experiment')
    assert [s for s, _ in scalars['Accuracy/validation']] == [0, 1, 2]
    steps = [s for s, _ in scalars['Loss/train']]
    assert steps == sorted(set(steps)) and len(steps) == 3 * 5  # 100 batches per rank, every 20th
    assert torch.load(out / 'checkpoint.pth', weights_only=True)['epochs_done'] == 3


def wait_in(readers, pattern, timeout=120):
    """The first match of pattern in the output of any of the readers (two launchers' outputs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for reader in readers:
            match = re.search(pattern, reader.drain(), re.M)
            if match:
                return match
        time.sleep(0.05)
    raise AssertionError(f'no {pattern!r} in:\n' + '\n---\n'.join(reader.drain() for reader in readers))


@pytest.mark.parametrize('rendezvous, victim', [('static', 0), ('c10d', 1), ('c10d', 0)])
@pytest.mark.slow
def test_two_nodes_restart_once_whichever_worker_dies(rendezvous, victim, mnist_big_dir, tmp_path):
    if rendezvous == 'c10d' and torch.__version__ < '2.4':
        pytest.skip("torch 2.3's elastic agent closes a c10d rendezvous on restart (pytorch/pytorch#123678)")
    out, port = tmp_path / 'out', free_port()
    nodes = []
    for node in (0, 1):  # two launchers, one process each: two "nodes" on loopback
        static = [f'--node_rank={node}', '--master_addr=127.0.0.1', f'--master_port={port}']
        where = (['--rdzv_backend=c10d', f'--rdzv_endpoint=127.0.0.1:{port}', '--rdzv_id=restart-test']
                 if rendezvous == 'c10d' else static)
        nodes.append(start(torchrun('--nnodes=2', '--nproc_per_node=1', *where, '--max-restarts=1', SCRIPT,
                                    '--data-dir', mnist_big_dir, '--output-dir', out, '--epochs', '3',
                                    '--log-interval', '20')))
    readers = [reader for _, reader in nodes]
    pid = int(wait_in(readers, rf'^Rank {victim}/2 \(local rank 0, pid (\d+)\)').group(1))
    wait_in(readers, rf'^Rank: {victim}, Local_Rank: 0 -- Train Epoch: 1 \[0/')
    os.kill(pid, signal.SIGSTOP)  # frozen mid-epoch: no rank can finish epoch 1 without it
    assert not any('Epoch 1 done' in reader.drain() for reader in readers), 'the kill came after epoch 1 ended'
    os.kill(pid, signal.SIGKILL)
    outputs = [reader.rest(timeout=240) for reader in readers]
    assert [proc.returncode for proc, _ in nodes] == [0, 0], outputs
    output = next(o for o in outputs if 'Training complete' in o)  # rank 0's node, after the restart
    before, resumed, after = output.partition('Resuming from epoch 1 ')
    assert resumed, output
    assert re.findall(r'^Epoch (\d) done', before, re.M) == ['0']
    assert re.findall(r'^Epoch (\d) done', after, re.M) == ['1', '2']
    assert len(re.findall(r'^Validation Loss', after, re.M)) == 2, 'each epoch after the resume validated once'
    assert [s for s, _ in read_scalars(out / 'runs' / 'mnist_experiment')['Accuracy/validation']] == [0, 1, 2]
    # The survivor: one paragraph (or the one line of a stop by its launcher), no traceback of ours and no
    # store's stack dump; torchrun's own report (its agent's exit barrier) may follow.
    for text in outputs:
        assert not re.search(r'File ".*(mnist_train_distributed|common)\.py"', text), text
        assert 'Error in sys.excepthook' not in text and not re.search(r'^\[rank\d\]:.*TCPStore', text, re.M), text
    lost = re.findall(r'^error: rank \d lost rank (\d) of 2 during epoch 1 \(.*\n', '\n'.join(outputs), re.M)
    assert lost in ([], [str(victim)]), outputs
    if rendezvous == 'static':
        assert lost == [str(victim)], 'the static rendezvous restarts only when the survivor fails too'


@pytest.mark.parametrize('victim', [1, 0])
@pytest.mark.slow
def test_a_hung_peer_is_named_as_hung_and_the_job_ends_within_two_collective_timeouts(victim, mnist_big_dir,
                                                                                       tmp_path):
    # DLC's static form, two launchers, --max-restarts=1; one rank's process stopped (SIGSTOP) mid-epoch, as a
    # stuck disk or a frozen GPU would leave it. A --join-timeout of 600 s would outlast the test: the job must
    # end on --collective-timeout (8 s) alone, twice: the survivor's wait, then its restart's.
    port, survivor = free_port(), 1 - victim
    nodes = [start(torchrun('--nproc_per_node=1', '--nnodes=2', f'--node_rank={node}', '--master_addr=127.0.0.1',
                            f'--master_port={port}', '--max-restarts=1', SCRIPT, '--data-dir', mnist_big_dir,
                            '--output-dir', tmp_path / 'out', '--epochs', '3', '--log-interval', '20',
                            '--collective-timeout', '8', '--join-timeout', '600')) for node in (0, 1)]
    readers = [reader for _, reader in nodes]
    pid = int(wait_in(readers, rf'^Rank {victim}/2 \(local rank 0, pid (\d+)\)').group(1))
    wait_in(readers, rf'^Rank: {victim}, Local_Rank: 0 -- Train Epoch: 1 \[0/')
    os.kill(pid, signal.SIGSTOP)
    try:
        output = readers[survivor].rest(timeout=150)
    finally:
        os.kill(pid, signal.SIGKILL)
        nodes[victim][0].terminate()
        readers[victim].rest(timeout=60)
    host = socket.gethostname() if victim == 1 else '127.0.0.1'  # a stuck rank 0: its store's address
    paragraph = re.search(rf'^error: rank {survivor} waited 8s for rank {victim} of 2 \({re.escape(host)}\) during '
                          rf'epoch 1 \(.*\): it stopped answering, but its process may still be alive and stuck .*: '
                          rf'look at that node\. Then torchrun restarts this node\'s processes now; they wait 8s for '
                          rf'it to join again, and the job ends if it does not\..* it resumes from epoch 1\.$',
                          output, re.M)
    assert paragraph, output
    assert f'The last attempt stopped because rank {victim} of 2 on {host} stopped answering during epoch 1: ' \
           f'waiting 8s (--collective-timeout) for it to join again.' in output
    rank, message = torchrun_report(output)['root']
    assert rank == survivor and message.startswith(
        f'error: rank {victim} of 2 did not join the job at 127.0.0.1:{port} within 8s. It stopped answering in '
        f'the last attempt (rank {victim} of 2 on {host} stopped answering during epoch 1) and is still stuck'), output
    assert nodes[survivor][0].returncode != 0 and 'its process or node is gone' not in output


# --- Other launchers: plain python per node (Kubeflow, DLC); waiting for the others ---------------

def test_plain_python_processes_with_a_launchers_variables_train_together(mnist_dir, tmp_path):
    out, port = tmp_path / 'out', free_port()
    procs = [start(dist_cmd('--data-dir', mnist_dir, '--output-dir', out, '--epochs', '1', *FAST),
                   env=script_env(RANK=str(rank), WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port)))
             for rank in (0, 1)]
    outputs = [reader.rest(timeout=120) for _, reader in procs]
    assert [proc.returncode for proc, _ in procs] == [0, 0], outputs
    for rank, output in enumerate(outputs):
        assert output.startswith('LOCAL_RANK is not set (started with python, not torchrun): one process on '
                                 'this node, LOCAL_RANK 0.\n')
        assert f'Joining the job at 127.0.0.1:{port} as rank {rank} of 2 (waiting up to 1800s for all ranks)' in output
    check_result(''.join(outputs), out, epochs=1, world_size=2)


@pytest.mark.parametrize('rank', [0, 1])
def test_a_rank_left_alone_says_where_it_waits_and_stops_in_time(rank, tmp_path):
    port = free_port()
    env = script_env(RANK=str(rank), WORLD_SIZE='2', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    proc, reader = start(dist_cmd(*in_tmp(tmp_path), '--join-timeout', '3'), env=env)
    line = reader.wait_for(lambda line: line.startswith('Joining'), timeout=30)  # at once, before any wait
    assert line == f'Joining the job at 127.0.0.1:{port} as rank {rank} of 2 (waiting up to 3s for all ranks)\n'
    output = reader.rest(timeout=30)  # the timeout is 3 s: well within 30
    assert proc.returncode == 1 and len(output.splitlines()) == 2, output  # no C++ log lines of c10d
    if rank == 0:  # it hosts the meeting point: it knows who did not come
        assert f'error: rank 1 of 2 did not join the job at 127.0.0.1:{port} within 3s' in output
    else:  # nobody listens at the master's address
        assert f'error: rank 1 could not reach the job at 127.0.0.1:{port} within 3s' in output
    assert '--join-timeout' in output


@pytest.mark.slow
def test_a_rank_late_in_the_set_up_is_named_on_every_rank(tmp_path):
    # peers.on_ranks with a set-up timeout of 6 s (30 minutes in the script), rank 1 busy for 12 s: the others name
    # it once the timeout is up, and rank 1 itself once it is done, each in one paragraph (its gather fails within
    # half the timeout: 3 s, time enough on a loaded machine).
    driver = tmp_path / 'late_rank.py'
    driver.write_text(f'''import os, sys, time
from datetime import timedelta
sys.path.insert(0, {str(ROOT)!r})
import torch, torch.distributed as dist
import common, peers
peers.SETUP_TIMEOUT = timedelta(seconds=6)
class Flags: join_timeout, collective_timeout = 60, 60
peers.check_environment()
rank, world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
store = peers.join(rank, world_size, Flags)
with peers.connecting(rank, world_size):
    dist.init_process_group('gloo', store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
try:
    peers.on_ranks(rank == 1, time.sleep, 12)
except common.SetupError as e:
    sys.stdout.write(f'rank {{rank}}: {{e}}\\n')  # one write: the ranks share the stream
    sys.stdout.flush()
''')
    _, stdout, _ = run(torchrun('--standalone', '--nproc_per_node=3', driver), check=False)
    said = dict(re.findall(r'^rank (\d): (.*)$', stdout, re.M))
    message = ('rank 1 of 3 did not finish setting up (reading the checkpoint, or the MNIST download) within 6s: '
               "look at its node's log.")
    assert said.get('0') == message and said.get('1') == message, stdout
