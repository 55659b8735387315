"""mnist_train_distributed.py on two hosts: two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2,
each with a host name of its own (node-0, node-1) and its own /etc/hosts, DLC's torchrun line on each with
--master_addr=10.77.0.1. Needs root, iproute2's `ip netns` and util-linux's `unshare`, as CI has them; skips
elsewhere, saying why.
"""
import os
import re
import shutil
import signal
import subprocess
import uuid

import pytest

from conftest import free_port, script_env, start, torchrun, torchrun_report

SCRIPT = 'mnist_train_distributed.py'
FAST = ('--epochs', '1', '--batch-size', '16', '--log-interval', '20', '--seed', '0')
# What each host's name resolves to, as /etc/hosts says: its own address (as Kubernetes writes it), a loopback
# address (as Debian's and Ubuntu's installers write it), nothing (a name no resolver knows).
RESOLVES = {'own': '10.77.0.{n}', 'debian': '127.0.1.1', 'nothing': None}
pytestmark = pytest.mark.one_leg  # the hosts' network, not torch's version: run in the PAI image's leg


@pytest.fixture(scope='module')
def hosts():
    """The two namespaces' names; removed at the end."""
    if os.geteuid() != 0 or not shutil.which('ip') or not shutil.which('unshare'):
        pytest.skip('two hosts need root, ip (iproute2) and unshare (util-linux)')
    tag = uuid.uuid4().hex[:6]
    names = [f'mnist{tag}a', f'mnist{tag}b']
    veth = [f'v{tag}a', f'v{tag}b']
    steps = [['ip', 'netns', 'add', names[0]], ['ip', 'netns', 'add', names[1]],
             ['ip', 'link', 'add', veth[0], 'type', 'veth', 'peer', 'name', veth[1]]]
    for n in (0, 1):
        steps += [['ip', 'link', 'set', veth[n], 'netns', names[n]],
                  ['ip', '-n', names[n], 'addr', 'add', f'10.77.0.{n + 1}/24', 'dev', veth[n]],
                  ['ip', '-n', names[n], 'link', 'set', veth[n], 'up'],
                  ['ip', '-n', names[n], 'link', 'set', 'lo', 'up']]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True)
        yield names
    except subprocess.CalledProcessError as e:
        pytest.skip(f'could not make two hosts ({" ".join(e.cmd)}: {e.stderr.strip()})')
    finally:
        for name in names:
            subprocess.run(['ip', 'netns', 'delete', name], capture_output=True)  # its end of the veth pair too
            shutil.rmtree(f'/etc/netns/{name}', ignore_errors=True)


def job(hosts, resolves, *args, env=None):
    """DLC's torchrun line on each host, whose name resolves as `resolves` says; [(proc, reader)] of node 0, 1."""
    nodes = []
    for n, name in enumerate(hosts):
        os.makedirs(f'/etc/netns/{name}', exist_ok=True)  # `ip netns exec` mounts these files over /etc's
        address = RESOLVES[resolves] and RESOLVES[resolves].format(n=n + 1)
        with open(f'/etc/netns/{name}/hosts', 'w') as f:
            f.write('127.0.0.1 localhost\n' + (f'{address} node-{n}\n' if address else ''))
        command = torchrun('--nproc_per_node=1', '--nnodes=2', f'--node_rank={n}', '--master_addr=10.77.0.1',
                           '--master_port=29500', SCRIPT, *args)
        nodes.append(start(['ip', 'netns', 'exec', name, 'unshare', '--uts', 'sh', '-c', 'hostname "$0" && exec "$@"',
                            f'node-{n}', *command], env=env or script_env()))
    return nodes


@pytest.fixture(scope='module')
def one_host_validation(mnist_dir, tmp_path_factory):
    """The validation lines of the same job with both nodes on this host's loopback."""
    port, out = free_port(), tmp_path_factory.mktemp('one_host')
    procs = [start(torchrun('--nproc_per_node=1', '--nnodes=2', f'--node_rank={n}', '--master_addr=127.0.0.1',
                            f'--master_port={port}', SCRIPT, '--data-dir', mnist_dir, '--output-dir', out, *FAST))
             for n in (0, 1)]
    outputs = [reader.rest(timeout=120) for _, reader in procs]
    assert [proc.returncode for proc, _ in procs] == [0, 0], outputs
    return re.findall(r'^Validation Loss: .*$', outputs[0], re.M)


@pytest.mark.parametrize('resolves', RESOLVES)
def test_the_job_trains_on_two_hosts_whatever_their_names_resolve_to(resolves, hosts, mnist_dir, tmp_path,
                                                                     one_host_validation):
    nodes = job(hosts, resolves, '--data-dir', mnist_dir, '--output-dir', tmp_path / 'out', *FAST)
    outputs = [reader.rest(timeout=120) for _, reader in nodes]
    assert [proc.returncode for proc, _ in nodes] == [0, 0], outputs
    assert re.findall(r'^Validation Loss: .*$', outputs[0], re.M) == one_host_validation, outputs[0]
    for n, output in enumerate(outputs):
        chosen = (f"This host's name node-{n} resolves to {'127.0.1.1' if resolves == 'debian' else 'no address'}, "
                  f"which the other hosts cannot reach: gloo takes ")
        if resolves == 'own':
            assert "This host's name" not in output and 'Unable to resolve hostname' not in output
        else:
            assert re.search(rf'^{re.escape(chosen)}\S+ \(10\.77\.0\.{n + 1}\), the interface toward MASTER_ADDR '
                             rf'10\.77\.0\.1; GLOO_SOCKET_IFNAME chooses another\.$', output, re.M), output


def test_a_rank_that_cannot_connect_says_so_and_the_others_stop_at_once_naming_it(hosts, mnist_dir, tmp_path):
    # Both hosts' gloo on the loopback interface, as without the interface choice: one rank's connection is refused,
    # and the other, which gloo would keep waiting five --collective-timeouts, stops with it.
    env = script_env(GLOO_SOCKET_IFNAME='lo')
    nodes = job(hosts, 'nothing', '--data-dir', mnist_dir, '--output-dir', tmp_path / 'out', *FAST,
                '--collective-timeout', '60', env=env)
    outputs = [reader.rest(timeout=50) for _, reader in nodes]  # well within one --collective-timeout
    reports = [torchrun_report(output)['root'] for output in outputs]
    (failed, paragraph), = [report for report in reports if 'could not connect' in report[1]]
    other = 1 - failed
    assert paragraph.startswith(f'error: rank {failed} (node-{failed}) could not connect to the other ranks while the '
                                f'process group was being made (') and 'GLOO_SOCKET_IFNAME' in paragraph, outputs
    assert reports[other] == (other, f"error: stopped because rank {failed} (node-{failed}) failed during set-up "
                                     f"(the root cause: see its node's report)"), outputs
    assert "This host's name" not in ''.join(outputs), 'a GLOO_SOCKET_IFNAME set is never overridden'


@pytest.mark.slow
def test_a_hung_peer_is_named_with_its_host_across_two_hosts(hosts, mnist_big_dir, tmp_path):
    nodes = job(hosts, 'nothing', '--data-dir', mnist_big_dir, '--output-dir', tmp_path / 'out', '--epochs', '2',
                '--log-interval', '20', '--collective-timeout', '8')
    readers = [reader for _, reader in nodes]
    pid = int(re.search(r'pid (\d+)', readers[1].wait_for(lambda line: line.startswith('Rank 1/2'))).group(1))
    readers[1].wait_for(lambda line: line.startswith('Rank: 1, Local_Rank: 0 -- Train Epoch: 0 [2560/'))
    os.kill(pid, signal.SIGSTOP)  # stuck on node-1, as on a hung disk
    try:
        output = readers[0].rest(timeout=60)
    finally:
        os.kill(pid, signal.SIGKILL)
        nodes[1][0].terminate()
        readers[1].rest(timeout=60)
    rank, message = torchrun_report(output)['root']
    assert rank == 0 and message.startswith('error: rank 0 waited 8s for rank 1 of 2 (node-1) during epoch 0 ('), output
