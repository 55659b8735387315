"""The distributed job's peers: what torchrun leaves to mnist_train_distributed.py.

What it guarantees:
- No wait outlasts the timeout it printed: joining (--join-timeout), a training step (--collective-timeout),
  the set-up (SETUP_TIMEOUT: rank 0's download, a checkpoint read on a slow mount).
- A rank that never joined, could not connect, failed during set-up, or was lost or hung during training is
  named, with its host where known, in one paragraph (common.SetupError) on every surviving rank, which then
  stops; torchrun's report shows it, the rank where the failure began as the root cause.
- Gloo connects between hosts whose names resolve to a loopback address or to none (choose_gloo_interface).
- A restarted attempt never meets a dead attempt's addresses, and waits for a peer that hung before only
  as long as a step would (--collective-timeout).

The script calls check_environment, check_backend, join, connecting, on_ranks, watched and report_failure.
"""
import contextlib
import ipaddress
import json
import os
import signal
import re
import socket
import struct
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common import SetupError, check_device

SETUP_TIMEOUT = timedelta(minutes=30)  # a set-up wait (rank 0's download) is for work, not for a peer
_job_store = None  # the job's key-value store, once joined: a survivor asks it who is gone
_agent_store = None  # torchrun's own store, where it has one: it outlives this attempt's processes
_setup_group = None  # the set-up's waits, on gloo with SETUP_TIMEOUT (on_ranks), made with the process group
_setup_step = 0  # on_ranks' calls, the same on every rank


def check_environment():
    """Whether a launcher set RANK, WORLD_SIZE and LOCAL_RANK, as torchrun does; a plain launcher's one process a
    node (no LOCAL_RANK) gets LOCAL_RANK 0, and a script started without one runs as a world of one."""
    env_names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')
    missing = [name for name in env_names if name not in os.environ]
    if not any(name in os.environ for name in env_names[:3]):  # MASTER_* alone may be left from elsewhere
        print('Not started by torchrun (no RANK, WORLD_SIZE, LOCAL_RANK): running as a world of one process.')
        os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0')
        return False
    if missing == ['LOCAL_RANK']:  # Kubeflow's PyTorchJob, or DLC's python start command: one process per node
        print('LOCAL_RANK is not set (started with python, not torchrun): one process on this node, LOCAL_RANK 0.')
        os.environ['LOCAL_RANK'] = '0'
    elif missing:
        raise SetupError(f'the distributed environment is half set: {", ".join(missing)} missing while '
                         f'{", ".join(n for n in env_names if n not in missing)} are set. Start the script with '
                         f'torchrun, which sets them all (on DLC: the README\'s torchrun line).')
    return True


def check_backend(args, local_rank):
    """The process group's backend, --backend or by default NCCL on GPUs and gloo on CPUs, once --device is one
    the distributed script takes: cpu, or cuda, where the process takes GPU LOCAL_RANK."""
    if args.device not in ('cpu', 'cuda'):
        raise SetupError(f'--device {args.device}: the distributed script trains on cpu, or on cuda, where '
                         f'each process takes GPU LOCAL_RANK (CUDA_VISIBLE_DEVICES chooses which GPUs).')
    backend = args.backend or ('nccl' if args.device == 'cuda' else 'gloo')
    if backend == 'nccl' and not (args.device == 'cuda' and torch.cuda.is_available()):
        raise SetupError('backend nccl needs CUDA, which is not available here or not chosen: '
                         'pass --device cuda on GPU nodes, or --backend gloo.')
    if args.device == 'cuda':
        check_device(f'cuda:{local_rank}')  # one GPU per process: at most as many processes as GPUs
    return backend


def join(rank, world_size, args):
    """Meet the other ranks at MASTER_ADDR:MASTER_PORT, saying so; return the job's store, once every rank is there.
    Quietly: TCPStore's own retries log C++ stack dumps."""
    global _job_store, _agent_store
    host, port, timeout = os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), args.join_timeout
    address, deadline = f'{host}:{port}', time.monotonic() + timeout
    print(f'Joining the job at {address} as rank {rank} of {world_size} (waiting up to {timeout:.0f}s for all ranks)')
    # torchrun's agent hosts the store where it says so; otherwise rank 0 does, at MASTER_ADDR:MASTER_PORT.
    in_agent = os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True'
    while in_agent or rank != 0:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise SetupError(f'rank {rank} could not reach the job at {address} within {timeout:.0f}s '
                                 f'({e.strerror or e}). Check that MASTER_ADDR and MASTER_PORT name rank 0\'s '
                                 f'node and that its job started; --join-timeout sets the wait.') from None
            time.sleep(0.2)
    choose_gloo_interface(host)  # MASTER_ADDR resolves by now
    store = dist.TCPStore(host, port, world_size, is_master=not in_agent and rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    hang = None
    if in_agent:
        _agent_store = store
        hang = store.get('mnist/hang').decode() if store.check(['mnist/hang']) else None  # recorded by peer_lost
        if hang:  # a stuck peer does not come back by itself: wait for it as long as a step would, no longer
            timeout = min(timeout, args.collective_timeout)
            deadline = min(deadline, time.monotonic() + timeout)
            print(f'The last attempt stopped because {hang}: waiting {timeout:.0f}s (--collective-timeout) for it '
                  f'to join again.')
        store = attempt_store(store, rank, world_size, max(1.0, deadline - time.monotonic()))
    keys = [f'joined/{r}' for r in range(world_size)]
    absent = [0]  # where rank 0 started no store for this attempt
    if store is not None:
        store.set(keys[rank], socket.gethostname())
        while not store.check(keys) and time.monotonic() < deadline:  # polled: store.wait's timeout logs C++ lines
            time.sleep(0.1)
        absent = [r for r, key in enumerate(keys) if not store.check([key])]
    if absent:
        reason = (f'It stopped answering in the last attempt ({hang}) and is still stuck: look at that node, then '
                  f'start the job again (on DLC, from the console); it resumes from its checkpoint.' if hang else
                  'Check that every node started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE; '
                  '--join-timeout sets the wait.')
        raise SetupError(f'rank{"s" if len(absent) > 1 else ""} {", ".join(map(str, absent))} of '
                         f'{world_size} did not join the job at {address} within {timeout:.0f}s. {reason}')
    # From here on every rank has come: making the process group waits as long as a step would (the set-up's waits
    # for work, rank 0's download, go through a group of their own: on_ranks)
    store.set_timeout(timedelta(seconds=args.collective_timeout))
    _job_store = store
    if hang and rank == 0:
        _agent_store.delete_key('mnist/hang')  # every rank is back: a later restart waits --join-timeout again
    return store


def choose_gloo_interface(master_addr):
    """Where this host's name resolves to a loopback address or to none, gloo would listen on the loopback
    interface, which the other hosts cannot reach: have it take the interface toward MASTER_ADDR (Linux's
    SIOCGIFADDR names it), unless GLOO_SOCKET_IFNAME chooses one or MASTER_ADDR is itself a loopback address."""
    def loopback_addresses(name):  # [] for a name that does not resolve, None for one with another address
        with contextlib.suppress(OSError):
            found = sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
            return found if all(ipaddress.ip_address(a.split('%')[0]).is_loopback for a in found) else None
        return []
    hostname = socket.gethostname()
    if 'GLOO_SOCKET_IFNAME' in os.environ or loopback_addresses(master_addr) is not None:
        return
    resolved = loopback_addresses(hostname)
    if resolved is None:
        return
    with contextlib.suppress(OSError, ImportError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        import fcntl  # not on Windows
        probe.connect((master_addr, 9))  # sends nothing: the system picks the route, and this end's address
        address = probe.getsockname()[0]
        for _, interface in socket.if_nameindex():
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                request = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack('256s', interface.encode()[:15]))
                if socket.inet_ntoa(request[20:24]) == address:
                    os.environ['GLOO_SOCKET_IFNAME'] = interface
                    print(f'This host\'s name {hostname} resolves to {", ".join(resolved) or "no address"}, which '
                          f'the other hosts cannot reach: gloo takes {interface} ({address}), the interface toward '
                          f'MASTER_ADDR {master_addr}; GLOO_SOCKET_IFNAME chooses another.')
                    return


@contextlib.contextmanager
def connecting(rank, world_size):
    """Make the set-up's gloo group once the process group is made, and turn a failure to connect into one
    paragraph. A rank that fails says so on the job's store, and the others, which gloo would keep waiting for it
    (five times --collective-timeout), stop at once naming it. (NCCL connects later, at DDP's first collective.)"""
    global _setup_group
    done = threading.Event()

    def failed_elsewhere():  # the error of a rank whose peer failed to connect first, or None
        with contextlib.suppress(Exception):  # the store went with its host: gloo's own wait ends this rank's
            if _job_store.check(['unconnected']):
                failed = int(_job_store.get('unconnected'))
                error = SetupError(f'rank {failed} ({host_of(failed)}) could not connect: see its paragraph.')
                error.origin = failed
                _job_store.add('unconnected/seen', 1)
                return error

    def watch():
        while not done.wait(0.5):
            error = failed_elsewhere()
            if error and not done.is_set():
                report_failure(error)
                os._exit(1)
    if _job_store is not None:
        threading.Thread(target=watch, daemon=True).start()
    try:
        yield
        if _job_store is not None:
            _setup_group = dist.new_group(backend='gloo', timeout=SETUP_TIMEOUT)
    except RuntimeError as e:  # DistBackendError and DistStoreError too
        done.set()
        error = failed_elsewhere()
        if error:  # another rank failed first: its failure is the cause
            raise error from None
        with contextlib.suppress(Exception):  # the store may end with this rank (or its node's torchrun): wait for
            # the others to read that it failed
            _job_store.set('unconnected', str(rank))
            deadline = time.monotonic() + 10
            while _job_store.add('unconnected/seen', 0) < world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        cause = re.sub(r'\[[^]]*\] ?', '', str(e).splitlines()[0])[:200]  # less the source files
        raise SetupError(
            f'rank {rank} ({socket.gethostname()}) could not connect to the other ranks while the process group was '
            f'being made ({cause}). Each host must reach the others at the address it listens on: where a host\'s '
            f'name resolves to a loopback address (127.0.1.1, as Debian and Ubuntu write it) or to none, set '
            f'GLOO_SOCKET_IFNAME (on GPUs also NCCL_SOCKET_IFNAME) to its interface toward MASTER_ADDR, on every '
            f'node; a firewall must let the hosts connect on any port.') from None
    finally:
        done.set()


def host_of(rank):
    """The host rank `rank` joined from, as it said on the job's store."""
    return _job_store.get(f'joined/{rank}').decode()


def attempt_store(agent_store, rank, world_size, timeout):
    """A store of this restart attempt's own, served by rank 0; its port is passed on through torchrun's. torchrun's
    store outlives restarts (pytorch/pytorch#135712: shared across c10d rounds), and with --rdzv_backend=c10d the
    nodes' TORCHELASTIC_RESTART_COUNT differ after a membership change: no prefix both agree on. In a dead attempt's
    keys a restarted rank would find dead addresses (a Gloo "Connection refused", an NCCL hang). Each attempt's store
    takes its world's arrivals once: one that has had them all is a dead attempt's, and its port is read again."""
    host = os.environ['MASTER_ADDR']
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
        store.add('arrivals', 1)
        agent_store.set('mnist/attempt_store_port', str(store.port))
        return store
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        port = int(agent_store.get('mnist/attempt_store_port'))  # waits, within the timeout, for a first one
        found = []

        def connect():  # on a thread: the store of a stuck rank 0 accepts connections and never answers
            with contextlib.suppress(OSError, RuntimeError):  # a dead attempt's port, or its rank 0 exiting now
                socket.create_connection((host, port), timeout=5).close()  # quietly, before TCPStore's noisy retries
                store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
                if store.add('arrivals', 1) <= world_size:
                    found.append(store)
        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        thread.join(max(0.1, min(10.0, deadline - time.monotonic())))
        if found:
            return found[0]
        time.sleep(0.2)
    return None  # rank 0 has not started this attempt's store


def on_ranks(selected, fn, *args):
    """fn(*args) on the selected ranks while the others wait; rank 0's result for all, or every rank raises.
    The wait goes through a gloo group of its own with SETUP_TIMEOUT: a download slower than
    --collective-timeout, or than NCCL's watchdog, is no lost peer."""
    global _setup_step
    result, error = None, None
    if selected:
        try:
            result = fn(*args)
        except Exception as e:
            error = e
    if _job_store is None:  # a world of one
        if error is not None:
            raise error
        return result
    rank, world_size, _setup_step = dist.get_rank(), dist.get_world_size(), _setup_step + 1
    _job_store.set(f'setup/{_setup_step}/{rank}', '')  # arrived: a rank that did not is named below
    replies, waiting = [None] * world_size, time.monotonic()
    try:
        dist.all_gather_object(replies, (result if rank == 0 else None, error and str(error)), group=_setup_group)
    except RuntimeError:
        late = [rank]  # given up at once: the others had stopped waiting for this rank
        if time.monotonic() - waiting > SETUP_TIMEOUT.total_seconds() / 2:
            late = [0]  # where the store went with rank 0's process
            with contextlib.suppress(Exception):
                late = [r for r in range(world_size) if not _job_store.check([f'setup/{_setup_step}/{r}'])] or late
        raise SetupError(f'rank{"s" * (len(late) > 1)} {", ".join(map(str, late))} of {world_size} did not finish '
                         f'setting up (reading the checkpoint, or the MNIST download) within '
                         f'{SETUP_TIMEOUT.total_seconds():.0f}s: look at its node\'s log.') from None
    if any(message for _, message in replies):
        with contextlib.suppress(RuntimeError):  # every rank has read the replies before any of them ends
            dist.barrier(_setup_group)
    if error is not None:
        raise error
    for r, (_, message) in enumerate(replies):
        if message is not None:
            error = SetupError(f'rank {r} failed during set-up: {message}')
            error.origin = r  # another rank's failure, not this one's
            raise error
    return replies[0][0]


@contextlib.contextmanager
def watched(epoch, rank, world_size, timeout):
    """Turn a failed collective (RuntimeError, DistBackendError too) into peer_lost's paragraph."""
    try:
        yield
    except RuntimeError as e:
        raise peer_lost(e, epoch, rank, world_size, timeout) from None


def peer_lost(error, epoch, rank, world_size, timeout):
    """The paragraph a surviving rank stops with when a collective fails: which ranks are gone, or stopped
    answering (hung: a collective waited `timeout` seconds for them), where, and what next."""
    cause = re.sub(r'^\[[^]]*\] ', '', str(error).splitlines()[0]).split('. ')[0][:160]  # less the source file
    if _job_store is None or not re.search(r'onnect|peer|NCCL|[Tt]imed out|closed', cause):
        return error  # not a lost peer: the traceback says what it is
    missing, hosts = silent_ranks(epoch, rank, world_size)
    ranks = f'rank{"s" * (len(missing) > 1)} {", ".join(map(str, missing)) or "?"} of {world_size}'
    if not re.search(r'[Tt]imed out|[Tt]imeout', cause):  # its connection closed: the process is gone
        return SetupError(
            f'rank {rank} lost {ranks} during epoch {epoch} ({cause}): its process or node is gone. A torchrun '
            f'started with --max-restarts restarts the job now; otherwise start the same command again on every '
            f'node. Either resumes from epoch {epoch}.')
    hang = f'{ranks} on {", ".join(sorted(set(hosts))) or "?"} stopped answering during epoch {epoch}'
    if _agent_store is not None and restarts_left():
        with contextlib.suppress(Exception):  # for the next attempt's wait (join); torchrun's agent keeps it
            _agent_store.set('mnist/hang', hang)
    then = (f'torchrun restarts this node\'s processes now; they wait {timeout:g}s for it to join again, and the job '
            f'ends if it does not' if restarts_left() and _agent_store is not None else 'this process stops now')
    return SetupError(
        f'rank {rank} waited {timeout:g}s for {ranks} ({", ".join(hosts) or "host unknown"}) during epoch {epoch} '
        f'({cause}): it stopped answering, but its process may still be alive and stuck (a hung data mount or disk, a '
        f'frozen GPU, a network that drops packets, a stopped process): look at that node. Then {then}. Once it is '
        f'healthy, start the job again (on DLC, from the console; otherwise the same command on every node): it '
        f'resumes from epoch {epoch}.')


def silent_ranks(epoch, rank, world_size):
    """The ranks that do not say they are alive on the job's store within a few seconds, and their hosts. When the
    store itself does not answer, its host is the silent one: rank 0."""
    answer = []

    def ask():  # on a thread: the store of a stuck rank 0 accepts connections and never answers
        with contextlib.suppress(Exception):  # the store went with rank 0, its host
            socket.create_connection((_job_store.host, _job_store.port), timeout=5).close()  # quietly, first
            _job_store.set(f'alive/{epoch}/{rank}', '1')
            time.sleep(2)
            missing = [r for r in range(world_size) if not _job_store.check([f'alive/{epoch}/{r}'])]
            answer.append((missing, [host_of(r) for r in missing]))
    time.sleep(1)  # a lost store's host has closed its port by now
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(15)
    return answer[0] if answer else ([0], [_job_store.host])


def restarts_left():
    """Whether torchrun will start this node's processes again when this one fails."""
    return int(os.environ.get('TORCHELASTIC_MAX_RESTARTS', 0)) > int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))


def report_failure(error):
    """Say why this process stops, in one paragraph: on stderr, or where torchrun will not restart it, in the
    error file torchrun hands each worker, whose `message` its failure report shows, naming the rank with the
    earliest `timestamp` as the root cause."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # failing already: torchrun's SIGTERM to the others ends them
        with contextlib.suppress(ValueError):  # quietly (not settable from connecting's thread, which then exits)
            signal.signal(signum, signal.SIG_DFL)
    message, path = f'error: {error}', os.environ.get('TORCHELASTIC_ERROR_FILE')
    if not path or restarts_left():
        sys.stderr.write(message + '\n')  # one write: the ranks of a job share the stream
        return
    origin = getattr(error, 'origin', None)
    if origin is not None:  # its paragraph is in the report of rank `origin`'s node; dated a second later
        origin_host = ''
        with contextlib.suppress(Exception):
            origin_host = f' ({host_of(origin)})'
        message = (f'error: stopped because rank {origin}{origin_host} failed during set-up (the root cause: see its '
                   f'node\'s report)')
    with open(path, 'w') as f:  # as torch's @record writes it (a plain message makes torchrun warn twice)
        json.dump({'message': {'message': message, 'extraInfo': {
            'py_callstack': message, 'timestamp': str(int(time.time()) + (origin is not None))}}}, f)
    first = int(os.environ['RANK']) - int(os.environ['LOCAL_RANK'])  # the ranks of a node are consecutive
    if origin in range(first, first + int(os.environ.get('LOCAL_WORLD_SIZE', 1))):  # rank `origin` is on this node
        # torchrun reports only the processes it has seen fail, then stops the others (newer ones than torch 2.3's
        # add these since pytorch/pytorch#160908): ending first, this process could be the only one it names.
        time.sleep(30)  # until torchrun stops it, once rank `origin` has ended
