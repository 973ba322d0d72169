"""docs/performance.md: the prose of template.md with every `{{block}}` filled in."""

import os
import re

from . import alloc_sections, cost_sections, machine, other_sections, trace_sections
from .common import load_criterion, means

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "template.md")


def blocks(target):
    """Every generated block of the document, by the name its placeholder uses."""
    estimates = load_criterion(target)
    crit = means(estimates)
    return {
        "machine": machine.describe(),
        "cost_model": cost_sections.cost_model(target),
        "hot_path": alloc_sections.hot_path(target, crit),
        "random_allocations": alloc_sections.random_allocations(target, crit),
        "traces": trace_sections.traces(target, crit),
        "multi_stream": other_sections.multi_stream(target, crit),
        "bookkeeping": other_sections.bookkeeping(target),
        "sim": other_sections.sim(estimates),
        "llama_decode": other_sections.llama_decode(target),
    }


def fill(template, values):
    """`template` with each `{{name}}` replaced by `values[name]`; every placeholder must have
    a value and every value a placeholder."""
    names = re.findall(r"\{\{(\w+)\}\}", template)
    missing = sorted(set(names) - set(values))
    unused = sorted(set(values) - set(names))
    if missing or unused:
        raise ValueError(f"template placeholders without values {missing}, values without "
                         f"placeholders {unused}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)].rstrip("\n"), template)


def render(target):
    with open(TEMPLATE) as f:
        template = f.read()
    return fill(template, blocks(target))
