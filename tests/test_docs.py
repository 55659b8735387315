"""The README and docs/ say what the code does, where a machine can tell: the flags table, the quoted
messages and log lines, the relative links, run_local.sh's own usage, the scripts' --help and what .ci/run runs."""
import ast
import difflib
import functools
import importlib
import re
import sys

import pytest

from conftest import ROOT, run, run_script

DOCS = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
SOURCES = sorted(ROOT.glob('*.py'))  # the scripts and the modules they import


@functools.cache  # the same sources for every doc
def code_strings():
    """Every string literal of the code (adjacent ones joined, as Python joins them), each f-string field
    marked by a NUL."""
    strings = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                strings.append(''.join(value.value if isinstance(value, ast.Constant) else '\x00'
                                       for value in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node.value)
    return strings


# What a quoted line leaves to the reader: …, ..., <...>, and ALLCAPS placeholders (PATH, N, R of W, Ts).
PLACEHOLDER = re.compile(r'…|\.\.\.|<[^>]+>|\b[A-Z]{1,7}s?\b')


def occurs_in_code(quote, strings):
    """Whether a quoted message is a part of some string of the code: the two agree everywhere except where
    the code has a field (any value may stand there: cuda, 0.01, /mnt/data/output, an OS error's words)
    or the quote a placeholder; the code may go on before and after the part quoted."""
    quote = PLACEHOLDER.sub('\x00', quote)
    quote = re.sub(r'(--[\w-]+) (?!is |was )[^\s,;)]+', '\\1 \x00', quote)  # a flag's value
    quote = re.sub(r'[^\s(]*/[^\s),;]*|\b\d[\d.:]*\b', '\x00', quote)  # paths, numbers, addresses
    wild = lambda text: set(text) <= set('\x00 ,;:()[]{}\'"')
    width = min(10, max(len(chunk) for chunk in quote.split('\x00')))
    chunks = [quote[i:i + width] for i in range(len(quote) - width + 1) if '\x00' not in quote[i:i + width]]
    for code in strings:
        if not any(chunk in code for chunk in chunks):
            continue  # shares no run of literal characters with this string
        opcodes = difflib.SequenceMatcher(None, quote, code, autojunk=False).get_opcodes()
        first, last = 0, len(opcodes) - 1
        if all(tag == 'equal' or (tag == 'insert' and (k in (first, last) or '\x00' in quote[max(0, i1 - 1):i1 + 1]
                                                        or wild(code[j1:j2])))
               or (tag in ('replace', 'delete') and ('\x00' in quote[i1:i2] or '\x00' in code[j1:j2]
                                                      or (tag == 'delete' and wild(quote[i1:i2]))))
               for k, (tag, i1, i2, j1, j2) in enumerate(opcodes)):
            return True
    return False


def quoted_messages(doc):
    """The messages a doc quotes: bold code spans (troubleshooting entries), and the first column of the
    log-line table."""
    text = doc.read_text()
    quotes = re.findall(r'\*\*`([^`]+)`\*\*', text)
    if doc.name == 'log-lines.md':
        quotes += re.findall(r'^\| `([^`]+)` \|', text, re.M)
    return quotes


@pytest.mark.parametrize('doc', DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_quoted_message_and_log_line_occurs_in_the_code(doc):
    strings = code_strings()
    missing = [quote for quote in quoted_messages(doc) if not occurs_in_code(quote, strings)]
    assert missing == [], f'{doc.name} quotes lines the code does not print: {missing}'


def test_the_checker_catches_a_message_the_code_does_not_print():
    strings = code_strings()
    assert occurs_in_code('Resuming from epoch N (best accuracy so far x%)', strings)
    assert not occurs_in_code('Resuming from step N (best accuracy so far x%)', strings)


@pytest.mark.parametrize('doc', DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    text = doc.read_text()
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
        if re.match(r'[a-z]+:', target):
            continue
        path, _, anchor = target.partition('#')
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f'{doc.name}: {target}'
        if anchor and file.suffix == '.md':
            headings = [re.sub(r'[^\w\- ]', '', h).strip().lower().replace(' ', '-')
                        for h in re.findall(r'^#+ (.*)$', file.read_text(), re.M)]
            assert anchor in headings, f'{doc.name}: {target} (headings: {headings})'


def readme_flags():
    """{flag: default} of the README's flags table."""
    table = (ROOT / 'README.md').read_text().split('## Flags')[1].split('\n## ')[0]
    return dict(re.findall(r'^\| `(--[\w-]+)` \| ([^|]+?) \|', table, re.M))


@pytest.mark.parametrize('module_name', ['mnist_train', 'mnist_train_distributed'])
def test_the_flags_table_names_each_flag_with_its_default(module_name, monkeypatch):
    script = importlib.import_module(module_name)
    monkeypatch.setattr(sys, 'argv', [module_name])
    defaults = vars(script.parse_args())
    documented = readme_flags()
    distributed_only = {'--backend', '--join-timeout', '--collective-timeout'}
    for flag in ['--' + name.replace('_', '-') for name in defaults]:
        assert flag in documented, f'{flag} of {module_name} is not in the README'
    for flag, default in documented.items():
        name = flag[2:].replace('-', '_')
        if flag in distributed_only and module_name == 'mnist_train':
            assert name not in defaults
            continue
        value = defaults[name]
        if isinstance(value, bool):
            assert default == ('on' if value else 'off'), flag
        elif flag == '--output-dir':
            assert f'`{value}`' in (ROOT / 'README.md').read_text().split('## Flags')[1].split('\n## ')[0]
        elif flag in ('--device', '--backend'):
            assert value in (None, 'cpu', 'cuda') and ('cuda' in default), flag
        else:
            assert default.strip('`') == str(value).rstrip('0').rstrip('.') if isinstance(value, float) \
                else default.strip('`') == str(value), (flag, default, value)


def test_run_local_help_prints_its_own_usage():
    for flag in ('--help', '-h'):
        returncode, stdout, stderr = run(['bash', ROOT / 'run_local.sh', flag], check=False, timeout=30)
        assert returncode == 0 and stdout.startswith('Run the two MNIST scripts') and 'usage: ' not in stdout
        assert './run_local.sh test' in stdout and '../shared' not in stdout


def test_run_local_names_an_unknown_command_and_the_ones_it_has():
    returncode, stdout, stderr = run(['bash', ROOT / 'run_local.sh', 'tests'], check=False, timeout=30)
    assert returncode == 2 and stdout == '' and stderr.startswith("run_local.sh: no command 'tests': test, ")
    assert len(stderr.splitlines()) == 1, stderr
    script = (ROOT / 'run_local.sh').read_text()
    usage = script.split('\nset -euo')[0]
    named = re.findall(r'[\w-]+', stderr.split(':')[2].split(', or none')[0])
    cases = re.findall(r'^([\w-]+)\)$', script, re.M)
    assert sorted(named) == sorted(cases) and all(f'./run_local.sh {name} ' in usage for name in named), named


def test_the_scripts_help_examples_write_to_different_folders():
    outputs = []
    for script in ('mnist_train.py', 'mnist_train_distributed.py'):
        _, stdout, _ = run_script([sys.executable, ROOT / script, '--help'])
        stdout = re.sub(r' *\\\n *', ' ', stdout)  # a command continued on the next line
        outputs.append(re.search(r'^ +(?:python|torchrun) .*--output-dir (\S+)', stdout, re.M).group(1))
    assert outputs[0] != outputs[1], outputs


def test_no_developer_paths_in_user_facing_text():
    for path in [*DOCS, ROOT / 'run_local.sh', *SOURCES]:
        assert '../shared' not in path.read_text(), path.name


def test_ci_runs_the_readmes_test_commands_with_room_for_one_environment():
    readme = ' '.join((ROOT / 'README.md').read_text().split())  # its words, whatever the line breaks
    commands = [line for line in (ROOT / '.ci' / 'run').read_text().splitlines() if line.startswith('./run_local.sh')
                or line.startswith('rm ')]
    assert commands == ['./run_local.sh test', 'rm -rf .venv', './run_local.sh test-pai'], commands
    assert all(f'`{command}`' in readme for command in commands[::2])
    assert 'it removes `.venv` between the two' in readme
    lines = (ROOT / '.ci' / 'run').read_text().splitlines()
    for leg in ('./run_local.sh test', './run_local.sh test-pai'):  # then checks that the suite left no file
        assert lines[lines.index(leg) + 1] == 'tree_is_clean', leg


def test_the_suite_runs_one_worker_more_than_the_cpus():
    import common
    import conftest
    assert conftest.pytest_xdist_auto_num_workers(None) == common.usable_cpus() + 1
    command = '-m pytest -q -n auto --dist loadgroup tests "$@"'
    assert (ROOT / 'run_local.sh').read_text().count(command) == 2
    assert "pytest-xdist's `-n auto` made one worker more than the CPUs" in ' '.join(
        (ROOT / 'docs' / 'testing.md').read_text().split())


def refusals():
    """(status, closes the connection) of every Refused(...) serve.py and framing.py raise."""
    found = set()
    trees = [ast.parse((ROOT / name).read_text()) for name in ('serve.py', 'asgi.py', 'framing.py')]
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'Refused':
            closes = any(k.arg == 'connection' and k.value.value == 'close' for k in node.keywords)
            for status in ast.walk(node.args[0]):  # 503 if queued else 504: both
                if isinstance(status, ast.Constant):
                    found.add((status.value, closes))
    return found


def test_serving_docs_list_every_status_and_every_reply_that_closes_the_connection():
    text = ' '.join((ROOT / 'docs' / 'serving.md').read_text().split())  # wherever its lines break
    statuses = text.split('`{"error": "…"}` with the status:')[1].split('One exception')[0]
    listed = {int(n) for n in re.findall(r'\b([45]\d\d)\b', statuses)}
    assert {status for status, _ in refusals()} | {500} <= listed, listed
    closing = text.split('After an')[1].split('which close it')[0]
    assert {status for status, closes in refusals() if closes} == {int(n) for n in re.findall(r'\b\d{3}\b', closing)}
    assert 'the server is busy reading other requests' in (ROOT / 'asgi.py').read_text()  # the 503 quoted there


def serve_defaults(monkeypatch):
    """{flag: default} of serve.py's parser."""
    import serve
    monkeypatch.setattr(sys, 'argv', ['serve.py'])
    return {'--' + name.replace('_', '-'): value for name, value in vars(serve.parse_args()).items()}


def test_the_serving_flags_table_names_each_flag_of_serve_py_with_its_default(monkeypatch):
    import common
    import serve
    defaults = serve_defaults(monkeypatch)
    table = (ROOT / 'docs' / 'serving.md').read_text().split('| flag | default | meaning |')[1].split('\n\n')[0]
    documented = {}
    for flags, values in re.findall(r'^\| (`--[^|]*`) \|([^|]*)\|', table, re.M):  # `--host`, `--port` | `h`, `p`
        documented.update(zip(re.findall(r'`(--[\w-]+)', flags), [value.strip(' `') for value in values.split(',')]))
    assert documented.keys() == defaults.keys()
    assert defaults.pop('--workers') == common.usable_cpus()
    assert documented.pop('--workers') == 'the usable CPUs (1 on Windows)'
    assert f'each with the model; at most {serve.MAX_WORKERS} |' in table
    for flag, value in defaults.items():
        shown = 'off' if value is False else '' if value is None else value
        assert documented[flag] == (f'{shown:g}' if isinstance(shown, float) else str(shown)), flag


def test_serve_py_help_shows_its_run_commands_and_each_flags_default(monkeypatch):
    import serve
    defaults = serve_defaults(monkeypatch)
    _, stdout, _ = run([sys.executable, ROOT / 'serve.py', '--help'])
    assert serve.__doc__.strip() in stdout  # the run commands as written, line for line
    assert '--predict FILE [FILE ...]' in stdout  # as the table and the docstring name its values
    helps = {}
    for entry in re.split(r'\n(?=  -)', re.split(r'\n(?:options|optional arguments):\n', stdout)[1]):
        parts = re.split(r'\s{2,}', entry.strip(), maxsplit=1)  # the option strings, then the help text
        helps[re.search(r'--[\w-]+', parts[0]).group()] = ' '.join(parts[1].split()) if len(parts) == 2 else ''
    for flag, value in defaults.items():
        shown = 'off' if value is False else f'{value:g}' if isinstance(value, float) else str(value)
        assert helps[flag] and (value is None or '(default: ' in helps[flag] and shown in helps[flag]), flag


def test_the_formats_served_are_those_the_docs_and_the_error_name():
    import framing
    text = ' '.join((ROOT / 'docs' / 'serving.md').read_text().split())
    listed = re.search(r'`POST /predict` takes an image \(([^:]+):', text)[1]
    assert [name.upper() for name in re.split(r', | or ', listed)] == list(framing.FORMATS)
    with pytest.raises(framing.NotAnImage) as error:
        framing.decode(b'no image')
    named = re.search(r'\((.*)\)', str(error.value))[1]
    assert [name.upper() for name in re.split(r', | or ', named)] == list(framing.FORMATS)


def test_serving_limits_are_the_codes():
    import asgi
    import framing
    import serve
    text = (ROOT / 'docs' / 'serving.md').read_text()
    assert asgi.MAX_BODY_BYTES == 10 * 2**20 and '| a request body | 10 MiB, 10,485,760 bytes' in text
    assert asgi.BODY_BUDGET == 80 * 2**20 and '| request bodies held at once | 80 MiB' in text
    assert serve.MAX_HEAD_BYTES == 16 * 2**10 and '| request line and headers | 16 KiB' in text
    assert framing.MAX_IMAGES == 16 and '| images in one request | 16 |' in text
    assert framing.MAX_SCANS == 100 and '| scans of a JPEG | 100: ' in text
    assert framing.MAX_PIXELS == 4096 * 4096 and '| a tile of a TIFF | 4096 x 4096 pixels' in text
    assert asgi.SPREAD_CHECK == 100 and 'every 100 replies a worker counts the connections that sent 3' in (
        ' '.join(text.split()))
    page = (ROOT / 'page' / 'index.html').read_text()
    assert 'const MAX_UPLOAD = 1000000, MAX_SIDE = 1024;' in page  # what serving.md says the page sends
    assert 'over 1 MB or 1024 pixels a side to 1024 pixels a side' in ' '.join(text.split())


@pytest.mark.parametrize('doc', DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_files_the_examples_send_are_in_the_repository(doc):
    for path in re.findall(r'(?:curl|base64)[^\n`]*?@?\b(page/[\w.]+|[\w-]+\.png)\b', doc.read_text()):
        assert (ROOT / path).exists(), f'{doc.name}: {path}'
