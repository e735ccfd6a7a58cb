"""(being written)"""

from __future__ import annotations


def add_parser(esub) -> None:
    """(being written)"""
