"""Form input for the API's serializers: a form (multipart or urlencoded) whose blank value is
refused like any other wrong one, and a boolean field that takes only what the schema says a boolean
is. Shared by every resource that reads a form or query parameters."""
from __future__ import annotations

from rest_framework import serializers


class FormSerializer(serializers.Serializer):
    """A serializer of a request's fields, as a form (multipart or urlencoded) or JSON, that takes
    only what the schema says:

    - in a form, an empty value is refused like any other wrong one: DRF alone reads ``k=`` as "not
      sent" and uses the default (or, in a PATCH, leaves the field as it was), so a value the schema
      says is an integer, a uuid, a date-time or a non-empty string would pass when blank;
    - in JSON, a string field's value is a string: DRF's ``CharField`` also takes a number and
      stores its text, which the schema (``type: string``) does not allow.

    Raises:
        ValidationError: ``{field: ["This field may not be blank."]}`` or ``{field: ["Not a valid
            string."]}`` (400 ``invalid``).
    """

    def to_internal_value(self, data):
        if hasattr(data, "getlist"):  # a QueryDict: multipart or urlencoded
            wrong = {name: ["This field may not be blank."] for name, field in self.fields.items()
                     if not field.read_only and not getattr(field, "allow_blank", False)
                     and "" in data.getlist(name)}
        else:
            wrong = {name: ["Not a valid string."] for name, field in self.fields.items()
                     if isinstance(field, serializers.CharField) and not field.read_only
                     and isinstance(data, dict) and name in data and data[name] is not None
                     and not isinstance(data[name], str)}
        if wrong:
            raise serializers.ValidationError(wrong)
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """A boolean as the schema says one is: JSON ``true`` / ``false``, or in a form, multipart part
    or query string the text ``true`` / ``false`` (any case: form encoders write Python's ``True``).
    DRF's own field also takes ``1``, ``0``, ``"yes"``, ``"off"``, ``"t"`` ... which the schema
    (``type: boolean``) does not allow: a client sending one has made a mistake it should hear about.

    Raises:
        ValidationError: ``"Must be a valid boolean."`` (400 ``invalid``).
    """

    def to_internal_value(self, data):
        if isinstance(data, bool):
            return data
        if isinstance(data, str) and data.lower() in ("true", "false"):
            return data.lower() == "true"
        self.fail("invalid", input=data)
