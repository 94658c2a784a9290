"""Enum fields of a received message, checked against the values their enum defines.

proto3 keeps an enum number it does not know as a bare number, so a request can carry a LinkRole of 9; code
that names the value (LinkRole.Name) or picks by it would then fail deep inside, answered as INTERNAL. Checked
where requests are decoded, any out-of-range enum in any request is refused as INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from shardtrain.errors import InvalidArgument


def check(message: Any) -> None:
    """InvalidArgument naming the first enum field of `message` (nested messages included) whose value its enum
    does not define, and the values it does."""
    bad = _first_bad(message)
    if bad is not None:
        where, enum, value = bad
        known = ", ".join(f"{v.name} ({v.number})" for v in enum.values)
        raise InvalidArgument(f"{message.DESCRIPTOR.name}{where} is {value}, which is no {enum.name}; "
                              f"expected one of {known}")


def _first_bad(message: Any) -> tuple[str, EnumDescriptor, int] | None:
    """(path below `message`, enum, value) of an out-of-range enum value, or None. Only set fields are read
    (ListFields): an unset enum is 0, which every proto3 enum defines."""
    watched = _fields_to_check(message.DESCRIPTOR)
    if not watched:
        return None
    for field, value in message.ListFields():
        if field not in watched:
            continue
        name = field.name
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            field, entries = field.message_type.fields_by_name["value"], value.items()
        else:
            entries = enumerate(value) if field.is_repeated else ((None, value),)
        for key, item in entries:
            bad = _bad_value(field, item)
            if bad is not None:
                index = "" if key is None else f"[{key!r}]"
                return f".{name}{index}{bad[0]}", bad[1], bad[2]
    return None


def _bad_value(field: FieldDescriptor, value: Any) -> tuple[str, EnumDescriptor, int] | None:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _first_bad(value)
    return None if value in field.enum_type.values_by_number else ("", field.enum_type, value)


@functools.cache  # per message type: a Link checks every item it receives
def _fields_to_check(descriptor: Descriptor) -> frozenset[FieldDescriptor]:
    """The fields of a message type that are enums, or messages with an enum somewhere inside."""
    return frozenset(field for field in descriptor.fields
                     if field.type == FieldDescriptor.TYPE_ENUM
                     or (field.type == FieldDescriptor.TYPE_MESSAGE and _holds_enum(field.message_type, frozenset())))


def _holds_enum(descriptor: Descriptor, visiting: frozenset) -> bool:
    if descriptor in visiting:  # a message type that contains itself: what it holds is counted where it started
        return False
    inside = visiting | {descriptor}
    return any(field.type == FieldDescriptor.TYPE_ENUM
               or (field.type == FieldDescriptor.TYPE_MESSAGE and _holds_enum(field.message_type, inside))
               for field in descriptor.fields)
