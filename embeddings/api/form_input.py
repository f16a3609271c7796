"""Form input for the API's serializers: a form (multipart or urlencoded) whose blank value is
refused like any other wrong one, and a boolean field that takes only what the schema says a boolean
is. Shared by every resource that reads a form or query parameters."""
from __future__ import annotations

from rest_framework import serializers


class FormSerializer(serializers.Serializer):
    """A serializer of form fields (multipart or urlencoded) in which an empty value is refused like
    any other wrong one: DRF alone reads ``k=`` as "not sent" and uses the default, so a value the
    schema says is an integer, a uuid or a date-time would pass when blank.

    Raises:
        ValidationError: ``{field: ["This field may not be blank."]}`` (400 ``invalid``).
    """

    def to_internal_value(self, data):
        if hasattr(data, "getlist"):  # a QueryDict: multipart or urlencoded
            blank = {name: ["This field may not be blank."] for name, field in self.fields.items()
                     if not field.read_only and not getattr(field, "allow_blank", False)
                     and "" in data.getlist(name)}
            if blank:
                raise serializers.ValidationError(blank)
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
