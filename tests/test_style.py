"""Lines a reader can see whole and functions that fit on a screen, in all of the project's Python."""
import ast

import pytest

from conftest import ROOT

PYTHON = sorted([*ROOT.glob('*.py'), *(ROOT / 'tests').glob('*.py')])
# Lines kept verbatim from the document's scripts, long as they are there.
DOCUMENT_LINES = {
    "            print(f'Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} "
    "({100. * batch_idx / len(train_loader):.0f}%)]\\tLoss: {loss.item():.6f}')",
}


@pytest.mark.parametrize('path', PYTHON, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_line_over_120_characters_but_the_documents_own(path):
    long = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1)
            if len(line) > 120 and line not in DOCUMENT_LINES]
    assert long == [], f'{path.name}: lines over 120 characters: {long}'


@pytest.mark.parametrize('name', [path.name for path in sorted(ROOT.glob('*.py'))])
def test_no_function_over_60_lines(name):
    tree = ast.parse((ROOT / name).read_text())
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert long == [], f'{name}: functions over 60 lines: {long}'
