"""Train the quick-start's CNN on MNIST with DistributedDataParallel (PAI-DLC quick start, part 4).

Start command on DLC (upload common.py beside this script; DLC sets WORLD_SIZE, RANK, MASTER_ADDR and
MASTER_PORT, and NPROC_PER_NODE for nodes with several GPUs):
  torchrun --nproc_per_node=1 --nnodes=${WORLD_SIZE} --node_rank=${RANK} \\
      --master_addr=${MASTER_ADDR} --master_port=${MASTER_PORT} /mnt/data/mnist_train_distributed.py
On your own machine (2 CPU processes):
  torchrun --standalone --nproc_per_node=2 mnist_train_distributed.py \\
      --data-dir ./data --output-dir ./output/distributed

Global rank 0 writes to --output-dir: best_model.pth (the best model's state_dict, keys as in the
single script), checkpoint.pth (the same command resumes from it) and TensorBoard logs in
runs/mnist_experiment. --epochs is a total: epochs done before a restart count.
"""
import argparse
import contextlib
import json
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torch.utils.tensorboard import SummaryWriter

try:
    import common
except ModuleNotFoundError as e:  # the script uploaded alone
    if e.name != 'common':
        raise
    sys.exit(f'error: common.py is missing: upload it beside {os.path.abspath(__file__)} (on DLC, to the same '
             f'folder of the dataset as the script).')

# Data preprocessing, as in the document
transform = transforms.Compose([
    transforms.ToTensor(),
    transforms.Normalize((0.5,), (0.5,))
])


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Hyperparameters: the document's values are the defaults.
    parser.add_argument('--batch-size', type=common.positive(int), default=64,
                        help='training batch size, of each process in the distributed script (default: 64)')
    parser.add_argument('--lr', type=common.positive(float), default=0.01, help='SGD learning rate (default: 0.01)')
    parser.add_argument('--epochs', type=common.positive(int), default=20,
                        help='total epochs, counting those done before a restart (default: 20)')
    parser.add_argument('--data-dir', default='/mnt/data/dataSet', type=common.mnist_root,
                        help='torchvision root: the files live in <data-dir>/MNIST/raw (default: /mnt/data/dataSet)')
    parser.add_argument('--output-dir', default='/mnt/data/output_distributed',
                        help='best_model.pth, checkpoint.pth and runs/ go here (default: %(default)s)')
    parser.add_argument('--log-interval', type=common.positive(int), default=100,
                        help='batches between training-loss lines (default: 100)')
    parser.add_argument('--val-batch-size', type=common.positive(int), default=1000,
                        help='validation batch size; does not change the results (default: 1000)')
    parser.add_argument('--seed', type=common.seed, default=0,
                        help='seed for the initial weights and the data order (default: 0)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                        help='cpu, cuda, and in the single script also cuda:N or mps; in the distributed script '
                             'cuda means GPU LOCAL_RANK (default: cuda if available, else cpu)')
    parser.add_argument('--backend', choices=['nccl', 'gloo'],
                        help='process-group backend (default: nccl on cuda, gloo on cpu)')
    parser.add_argument('--join-timeout', type=common.positive(float, most=common.MAX_SECONDS), default=1800,
                        help='seconds to wait for every process of the job to start and connect (default: 1800)')
    parser.add_argument('--collective-timeout', type=common.positive(float, most=common.MAX_SECONDS), default=300,
                        help='seconds a step may wait for the other processes (an epoch takes seconds) before the '
                             'job stops, naming the one that stopped answering (default: 300)')
    parser.add_argument('--no-resume', action='store_true',
                        help='ignore <output-dir>/checkpoint.pth and start from epoch 0 (default: resume)')
    parser.add_argument('--debug', action='store_true', help='show tracebacks for set-up errors (default: off)')
    return parser.parse_args()


job_store = None  # the job's key-value store, once joined: set-up waits go through it; a survivor asks who is gone
agent_store = None  # torchrun's own store, where it has one: it outlives this attempt's processes
setup_step = 0  # on_ranks' calls, the same on every rank: each has keys of its own in the store
SETUP_TIMEOUT = timedelta(minutes=30)  # a set-up wait (rank 0's download) is for work, not for a peer


def ddp_setup(args):
    """Join the job (alone, a world of one); return rank, world_size, local_rank, device."""
    if args.device not in ('cpu', 'cuda'):
        raise common.SetupError(f'--device {args.device}: the distributed script trains on cpu, or on cuda, where '
                                f'each process takes GPU LOCAL_RANK (CUDA_VISIBLE_DEVICES chooses which GPUs).')
    rank, world_size, local_rank, launched = read_environment()
    backend = args.backend or ('nccl' if args.device == 'cuda' else 'gloo')
    if backend == 'nccl' and not (args.device == 'cuda' and torch.cuda.is_available()):
        raise common.SetupError('backend nccl needs CUDA, which is not available here or not chosen: '
                                'pass --device cuda on GPU nodes, or --backend gloo.')
    if args.device == 'cuda':
        common.check_device(f'cuda:{local_rank}')  # one GPU per process: at most as many processes as GPUs
        torch.cuda.set_device(local_rank)  # before the process group, so NCCL binds this GPU
        device = torch.device('cuda', local_rank)
    else:
        device = torch.device('cpu')
    store = join(rank, world_size, device, args) if launched else dist.HashStore()
    # Training's collectives wait --collective-timeout for a peer, on gloo and NCCL alike (their own defaults:
    # 30 and 10 minutes); the set-up's waits go through the store, with SETUP_TIMEOUT (on_ranks).
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.collective_timeout))
    print(f'Rank {rank}/{world_size} (local rank {local_rank}, pid {os.getpid()}) on {device} with {backend}')
    return rank, world_size, local_rank, device


def read_environment():
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them, or as plain launchers do (no LOCAL_RANK)."""
    env_names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')
    missing = [name for name in env_names if name not in os.environ]
    if 'RANK' not in os.environ and int(os.environ.get('SLURM_NTASKS') or 1) > 1:
        raise common.SetupError(
            f'started by SLURM as {os.environ["SLURM_NTASKS"]} tasks without torchrun: each would train alone, and '
            f'all would write one output folder. Start one torchrun per node inside srun instead: srun '
            f'--ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc_per_node=<GPUs per node> '
            f'--rdzv_backend=c10d --rdzv_endpoint=<first node>:29500 mnist_train_distributed.py')
    if not any(name in os.environ for name in env_names[:3]):  # MASTER_* alone may be left from elsewhere
        print('Not started by torchrun (no RANK, WORLD_SIZE, LOCAL_RANK): running as a world of one process.')
        return 0, 1, 0, False
    if missing == ['LOCAL_RANK']:  # Kubeflow's PyTorchJob, or DLC's python start command: one process per node
        print('LOCAL_RANK is not set (started with python, not torchrun): one process on this node, LOCAL_RANK 0.')
        os.environ['LOCAL_RANK'] = '0'
    elif missing:
        raise common.SetupError(f'the distributed environment is half set: {", ".join(missing)} missing while '
                                f'{", ".join(n for n in env_names if n not in missing)} are set. Start the script with '
                                f'torchrun, which sets them all (on DLC: the README\'s torchrun line).')
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    return rank, world_size, local_rank, True


def join(rank, world_size, device, args):
    """Meet the other ranks at MASTER_ADDR:MASTER_PORT, saying so, and check one GPU per process; return the store."""
    address, timeout = f'{os.environ["MASTER_ADDR"]}:{os.environ["MASTER_PORT"]}', args.join_timeout
    print(f'Joining the job at {address} as rank {rank} of {world_size} (waiting up to {timeout:.0f}s for all ranks)')
    # torchrun's agent hosts the store where it says so; otherwise rank 0 does, at MASTER_ADDR:MASTER_PORT.
    is_master = rank == 0 and os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True'
    deadline = time.monotonic() + timeout
    while not is_master:  # waited for quietly, within the timeout: TCPStore's own retries log C++ stack dumps
        try:
            socket.create_connection((os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT'])),
                                     timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise common.SetupError(f'rank {rank} could not reach the job at {address} within {timeout:.0f}s '
                                        f'({e.strerror or e}). Check that MASTER_ADDR and MASTER_PORT name rank 0\'s '
                                        f'node and that its job started; --join-timeout sets the wait.') from None
            time.sleep(0.2)
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size, is_master=is_master,
                          timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())), wait_for_workers=False)
    hang = None
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':
        global agent_store
        agent_store, hang = store, last_hang(store)
        if hang:  # a stuck peer does not come back by itself: wait for it as long as a step would, no longer
            timeout = min(timeout, args.collective_timeout)
            deadline = min(deadline, time.monotonic() + timeout)
            print(f'The last attempt stopped because {hang}: waiting {timeout:.0f}s (--collective-timeout) for it '
                  f'to join again.')
        store = attempt_store(store, rank, world_size, max(1.0, deadline - time.monotonic()))
    keys = [f'joined/{r}' for r in range(world_size)]
    if store is not None:
        store.set(keys[rank], f'{socket.gethostname()} {gpu_name(device)}')
    absent = absent_ranks(store, keys, deadline)
    if absent:
        reason = (f'It stopped answering in the last attempt ({hang}) and is still stuck: look at that node, then '
                  f'start the job again (on DLC, from the console); it resumes from its checkpoint.' if hang else
                  'Check that every node started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE; '
                  '--join-timeout sets the wait.')
        raise common.SetupError(f'rank{"s" if len(absent) > 1 else ""} {", ".join(map(str, absent))} of '
                                f'{world_size} did not join the job at {address} within {timeout:.0f}s. {reason}')
    store.set_timeout(SETUP_TIMEOUT)  # from here on, waits are for work (a download), not for ranks
    global job_store
    job_store = store
    if hang and rank == 0:
        agent_store.delete_key('mnist/hang')  # every rank is back: a later restart waits --join-timeout again
    if device.type == 'cuda':
        message = shared_gpus([store.get(key).decode() for key in keys])
        if message:
            raise common.SetupError(message)
    return store


def absent_ranks(store, keys, deadline):
    """Wait until every rank has set its key; the ranks that have not by the deadline ([0] where rank 0 started
    no store for this attempt)."""
    if store is None:
        return [0]
    while not store.check(keys):  # polled, not store.wait(): its timeout logs C++ warnings on newer torch
        if time.monotonic() >= deadline:
            return [r for r, key in enumerate(keys) if not store.check([key])]
        time.sleep(0.1)
    return []


def gpu_name(device):
    """What tells this process's GPU from the others of its host, whatever CUDA_VISIBLE_DEVICES each process
    has: its uuid, or where torch has none (2.3) its PCI bus id; 'cpu' on the CPU."""
    if device.type != 'cuda':
        return 'cpu'
    uuid = getattr(torch.cuda.get_device_properties(device), 'uuid', None)
    return str(uuid) if uuid else pci_bus_id(device.index)


def pci_bus_id(index):
    """The PCI bus id ('0000:3B:00.0') of this process's CUDA device `index`, from the CUDA runtime torch has
    loaded; where it cannot be read, the device's place among the visible ones (which tells fewer cases)."""
    import ctypes
    import ctypes.util
    with contextlib.suppress(OSError):
        with open('/proc/self/maps') as maps:  # the very library torch uses (Linux)
            loaded = [line.split()[-1] for line in maps if 'libcudart' in line]
        for path in [*loaded, ctypes.util.find_library('cudart')]:
            if not path:
                continue
            runtime, bus_id = ctypes.CDLL(path), ctypes.create_string_buffer(32)
            if runtime.cudaDeviceGetPCIBusId(bus_id, len(bus_id), index) == 0:  # cudaSuccess
                return f'PCI {bus_id.value.decode()}'
    return f'cuda:{index} of CUDA_VISIBLE_DEVICES={os.environ.get("CUDA_VISIBLE_DEVICES", "all")}'


def last_hang(agent_store):
    """Which ranks stopped answering in the last attempt of this job, and where, as recorded in torchrun's store
    by the rank that waited for them (peer_lost); None if none did."""
    if not agent_store.check(['mnist/hang']):
        return None
    return agent_store.get('mnist/hang').decode()


def attempt_store(agent_store, rank, world_size, timeout):
    """A store of this restart attempt's own, served by rank 0; its port is passed on through torchrun's.

    torchrun's store outlives restarts (pytorch/pytorch#135712: shared across c10d rounds), and with
    --rdzv_backend=c10d the nodes' TORCHELASTIC_RESTART_COUNT differ after a membership change: no prefix
    both agree on. In a dead attempt's keys a restarted rank would find dead addresses (a Gloo "Connection
    refused", an NCCL hang). Each attempt's store takes its world's arrivals once: one that has had them all
    is a dead attempt's (its rank 0 may not have exited yet), and its port is read again.
    """
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


def shared_gpus(placements):
    """Given each rank's 'host gpu', say which ranks share a GPU (None if none do): one process per GPU."""
    ranks_on = {}
    for rank, placement in enumerate(placements):
        ranks_on.setdefault(placement, []).append(rank)
    shared = [(placement.split()[0], ranks) for placement, ranks in ranks_on.items() if len(ranks) > 1]
    if not shared:
        return None
    where = '; '.join(f'ranks {", ".join(map(str, ranks))} on one GPU of {host}' for host, ranks in shared)
    return (f'two processes landed on the same GPU ({where}). Start one process per GPU: --nproc_per_node at '
            f'most the GPUs of each node, and each node of the job on a host of its own.')


def peer_lost(error, epoch, rank, world_size, timeout):
    """The paragraph a surviving rank stops with when a collective fails: which ranks are gone, or stopped
    answering (hung: a collective waited `timeout` seconds for them), where, and what next."""
    cause = re.sub(r'^\[[^]]*\] ', '', str(error).splitlines()[0]).split('. ')[0][:160]  # less the source file
    if job_store is None or not re.search(r'onnect|peer|NCCL|[Tt]imed out|closed', cause):
        return error  # not a lost peer: the traceback says what it is
    missing, hosts = silent_ranks(epoch, rank, world_size)
    ranks = f'rank{"s" * (len(missing) > 1)} {", ".join(map(str, missing)) or "?"} of {world_size}'
    if not re.search(r'[Tt]imed out|[Tt]imeout', cause):  # its connection closed: the process is gone
        return common.SetupError(
            f'rank {rank} lost {ranks} during epoch {epoch} ({cause}): its process or node is gone. A torchrun '
            f'started with --max-restarts restarts the job now; otherwise start the same command again on every '
            f'node. Either resumes from epoch {epoch}.')
    hang = f'{ranks} on {", ".join(sorted(set(hosts))) or "?"} stopped answering during epoch {epoch}'
    if agent_store is not None and restarts_left():
        with contextlib.suppress(Exception):  # for the next attempt's wait (join); torchrun's agent keeps it
            agent_store.set('mnist/hang', hang)
    then = (f'torchrun restarts this node\'s processes now; they wait {timeout:g}s for it to join again, and the job '
            f'ends if it does not' if restarts_left() and agent_store is not None else 'this process stops now')
    return common.SetupError(
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
            socket.create_connection((job_store.host, job_store.port), timeout=5).close()  # quietly, first
            job_store.set(f'alive/{epoch}/{rank}', '1')
            time.sleep(2)
            missing = [r for r in range(world_size) if not job_store.check([f'alive/{epoch}/{r}'])]
            answer.append((missing, [job_store.get(f'joined/{r}').decode().split()[0] for r in missing]))
    time.sleep(1)  # a lost store's host has closed its port by now
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(15)
    return answer[0] if answer else ([0], [job_store.host])


@contextlib.contextmanager
def peers_watched(epoch, rank, world_size, timeout):
    """Turn a failed collective (RuntimeError, DistBackendError too) into peer_lost's paragraph."""
    try:
        yield
    except RuntimeError as e:
        raise peer_lost(e, epoch, rank, world_size, timeout) from None


def on_ranks(selected, fn, *args):
    """fn(*args) on the selected ranks while the others wait; rank 0's result for all, or everyone raises.
    The wait goes through the job's store, with SETUP_TIMEOUT: a download slower than --collective-timeout, or
    than NCCL's watchdog, is no lost peer."""
    result, error = None, None
    if selected:
        try:
            result = fn(*args)
        except Exception as e:
            error = e
    if job_store is None:  # a world of one
        if error is not None:
            raise error
        return result
    global setup_step
    setup_step += 1
    rank, world_size = dist.get_rank(), dist.get_world_size()
    keys = [f'setup/{setup_step}/{r}' for r in range(world_size)]
    job_store.set(keys[rank], pickle.dumps((result if rank == 0 else None, None if error is None else str(error))))
    deadline = time.monotonic() + SETUP_TIMEOUT.total_seconds()
    while not job_store.check(keys):  # polled: see join
        if time.monotonic() > deadline:
            late = [r for r, key in enumerate(keys) if not job_store.check([key])]
            raise common.SetupError(f'rank{"s" * (len(late) > 1)} {", ".join(map(str, late))} of {world_size} did '
                                    f'not finish setting up (reading the checkpoint, or the MNIST download) within '
                                    f'{SETUP_TIMEOUT.total_seconds():.0f}s: look at its node\'s log.')
        time.sleep(0.05)
    replies = [pickle.loads(job_store.get(key)) for key in keys]
    # The store may live in rank 0's process: it ends only once every rank has read the replies.
    read = job_store.add(f'setup/{setup_step}/read', 1)
    while rank == 0 and read < world_size and any(message for _, message in replies) and time.monotonic() < deadline:
        time.sleep(0.05)
        read = job_store.add(f'setup/{setup_step}/read', 0)
    if error is not None:
        raise error
    for r, (_, message) in enumerate(replies):
        if message is not None:
            error = common.SetupError(f'rank {r} failed during set-up: {message}')
            error.origin = r  # another rank's failure, not this one's
            raise error
    return replies[0][0]


def restarts_left():
    """Whether torchrun will start this node's processes again when this one fails."""
    return int(os.environ.get('TORCHELASTIC_MAX_RESTARTS', 0)) > int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))


def report_failure(error):
    """Say why this process stops, in one paragraph: on stderr, or where torchrun will not restart it, in the
    error file torchrun hands each worker (as torch.distributed.elastic's @record writes it), which its failure
    report quotes, naming the rank where the failure began as the root cause."""
    message, path = f'error: {error}', os.environ.get('TORCHELASTIC_ERROR_FILE')
    if not path or restarts_left():
        sys.stderr.write(message + '\n')  # one write: the ranks of a job share the stream
        return
    origin = getattr(error, 'origin', None)
    if origin is not None:  # its paragraph is in the report of rank `origin`'s node; dated a second later
        message = f'error: stopped because rank {origin} failed during set-up (the root cause: see its node\'s report)'
    with open(path, 'w') as f:  # the report shows py_callstack: here the paragraph, not a traceback
        json.dump({'message': {'message': message, 'extraInfo': {
            'py_callstack': message, 'timestamp': str(int(time.time()) + (origin is not None))}}}, f)
    first = int(os.environ['RANK']) - int(os.environ['LOCAL_RANK'])  # the ranks of a node are consecutive
    if origin in range(first, first + int(os.environ.get('LOCAL_WORLD_SIZE', 1))):  # rank `origin` is on this node
        # torchrun reports only the processes it has seen fail, then stops the others (newer ones than torch 2.3's
        # add these since pytorch/pytorch#160908): ending first, this process could be the only one it names.
        time.sleep(30)  # until torchrun stops it, once rank `origin` has ended


def train(model, train_loader, optimizer, criterion, epoch, device, writer, log_interval, rank, local_rank, world_size):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)  # no-op: already there
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % log_interval == 0:
            loss_value = loss.item()  # the loop's one host sync, at log lines only
            print(f"Rank: {rank}, Local_Rank: {local_rank} -- Train Epoch: {epoch} "
                  f"[{batch_idx * len(data) * world_size}/{len(train_loader.dataset)} "
                  f"({100. * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss_value:.6f}")
            if rank == 0:
                writer.add_scalar('Loss/train', loss_value, epoch * len(train_loader) + batch_idx)
            all_losses = loss.detach().clone()
            dist.all_reduce(all_losses)  # nan or inf on any rank makes the sum so: every rank stops
            common.check_finite(all_losses.item(), epoch, batch_idx)


def validate(model, val_loader, criterion, device, writer, epoch, rank):
    """The document's validation and its record; the sums stay on the device until the end."""
    model.eval()
    val_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in val_loader:
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            output = model(data)
            val_loss += criterion(output, target) * data.size(0)  # the batch's sum, not its mean
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum()
    # Each rank validated its own share of the test set: together, every image once
    dist.all_reduce(val_loss, op=dist.ReduceOp.SUM)
    dist.all_reduce(correct, op=dist.ReduceOp.SUM)
    val_loss, correct = val_loss.item(), correct.item()
    val_loss /= len(val_loader.dataset)  # per sample (the document's single script divides by the number of batches)
    val_accuracy = 100. * correct / len(val_loader.dataset)
    common.check_finite(val_loss, epoch)  # a diverged model is neither reported as best nor saved
    if rank != 0:
        return val_loss, val_accuracy  # rank 0 alone reports
    print(f'Validation Loss: {val_loss:.4f}, Accuracy: {correct}/{len(val_loader.dataset)} ({val_accuracy:.0f}%)')
    writer.add_scalar('Loss/validation', val_loss, epoch)
    writer.add_scalar('Accuracy/validation', val_accuracy, epoch)
    return val_loss, val_accuracy


def prepare_data(args, rank, world_size, local_rank, device):
    """The data of this rank: its sampler and loader of the training set, and its share of the test set."""
    for first in (rank == 0, local_rank == 0 and rank != 0):
        on_ranks(first, common.prepare_mnist, args.data_dir)
    train_dataset = datasets.MNIST(root=args.data_dir, train=True, download=False, transform=transform)
    val_dataset = datasets.MNIST(root=args.data_dir, train=False, download=False, transform=transform)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = common.TensorLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler, device=device)
    val_loader = common.TensorLoader(val_dataset, batch_size=args.val_batch_size,
                                     sampler=range(rank, len(val_dataset), world_size), device=device)
    return train_sampler, train_loader, val_loader


def main(args):
    # Hyperparameters: the flags, whose defaults are the document's values
    batch_size, learning_rate, num_epochs = args.batch_size, args.lr, args.epochs

    # Device: the GPU if there is one (in the distributed script, this process's own)
    rank, world_size, local_rank, device = ddp_setup(args)

    # Restarts: checked before any data is read; an earlier run's checkpoint.pth is picked up
    best_model_path = os.path.join(args.output_dir, 'best_model.pth')
    checkpoint = on_ranks(rank == 0, common.load_checkpoint, args)
    if common.training_complete(checkpoint, num_epochs, best_model_path, main_process=rank == 0):
        return

    # Data: rank 0 downloads, then each other node's first process if it sees none; disjoint validation shares
    train_sampler, train_loader, val_loader = prepare_data(args, rank, world_size, local_rank, device)

    # Model, on the GPU if there is one
    torch.manual_seed(args.seed)
    model = common.SimpleCNN().to(device)
    if device.type == 'cpu':  # channels_last: a third faster on torch 2.3's CPU convolutions
        model = model.to(memory_format=torch.channels_last)
    # rank 0's weights everywhere; device_ids only on a GPU
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == 'cuda' else None)
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=learning_rate)
    start_epoch, best_val_accuracy, best_epoch = common.resume(checkpoint, model.module, optimizer, best_model_path,
                                                               main_process=rank == 0)

    # TensorBoard (purge_step: steps an interrupted run logged past its checkpoint are hidden)
    writer = (SummaryWriter(f'{args.output_dir}/runs/mnist_experiment', purge_step=start_epoch * len(train_loader))
              if rank == 0 else None)

    run_start = time.perf_counter()  # training, with validation after each epoch
    for epoch in range(start_epoch, num_epochs):
        epoch_start = time.perf_counter()
        train_sampler.set_epoch(epoch)  # a new order each epoch, the same one after a restart
        # A failed or timed-out collective: which rank is gone or hung, in one paragraph
        with peers_watched(epoch, rank, world_size, args.collective_timeout):
            train(model, train_loader, optimizer, criterion, epoch, device, writer, args.log_interval, rank, local_rank,
                  world_size)
            val_loss, val_accuracy = validate(model, val_loader, criterion, device, writer, epoch, rank)
        if rank != 0:
            continue  # rank 0 alone logs and saves
        # Save the model with the best validation accuracy, then the checkpoint (logs first)
        if val_accuracy > best_val_accuracy:
            best_val_accuracy = val_accuracy
            best_epoch = epoch
            common.save_atomic(model.module.state_dict(), best_model_path)  # no 'module.' in the keys
            print(f'Model saved with accuracy: {best_val_accuracy:.2f}%')
        common.save_checkpoint(args, writer, model.module, optimizer, epoch + 1, best_val_accuracy, best_epoch)
        epoch_time = time.perf_counter() - epoch_start
        print(f'Epoch {epoch} done in {epoch_time:.2f}s ({len(train_loader.dataset) / epoch_time:.0f} samples/s)')
    if rank != 0:
        return
    # TensorBoard's other tabs: the best model's mistakes, PR curves, graph, hyperparameters
    common.review_best_model(writer, args, best_model_path, val_loader, best_val_accuracy, best_epoch, world_size)
    writer.close()
    print(f'Best accuracy {best_val_accuracy:.2f}% at epoch {best_epoch}, saved in {best_model_path}; '
          f'{num_epochs - start_epoch} epochs in {time.perf_counter() - run_start:.1f}s')
    print('Training complete. writer.close()')


if __name__ == '__main__':
    # Whole lines, each as soon as it is printed: DLC's log view is live and ranks share one stream.
    sys.stdout.reconfigure(line_buffering=True, write_through=False, errors='surrogateescape')  # any path's bytes
    args = parse_args()
    common.stop_on_signals(args, main_process=int(os.environ.get('RANK', 0)) == 0)  # one line, from rank 0
    common.limit_cpu_threads()  # torch counts the host's cores, not a container's CPU quota
    try:
        main(args)
    except common.SetupError as e:
        if args.debug:
            raise
        # Failing already: torchrun's SIGTERM to the other processes ends them quietly
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        report_failure(e)
        sys.exit(1)
    except BrokenPipeError:  # the reader of its output is gone (| head): end quietly, as Unix tools do
        sys.exit(141)  # 128 + SIGPIPE, as the shell reports a tool ended by it
    finally:
        if dist.is_initialized():
            # Before torch 2.8, Gloo's teardown holds the GIL while its threads may still need it to
            # free the last collective's tensors, and hangs (pytorch/pytorch#154976): let them finish.
            time.sleep(0.1)
            dist.destroy_process_group()
