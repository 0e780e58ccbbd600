"""Structured workloads: JSON extraction to a schema, and tool-call arguments, each prompt with its own JSON Schema.

A configuration runs them with its constraint (`+schema`: SamplingParams.structured, the schema of the prompt) or
without; every output is checked (parses as JSON and validates against the prompt's schema) for the validity rate.
Prompts are plain text (no chat template), so they run on base and chat models alike.
"""
from __future__ import annotations

import json

from ..config import StructuredOutput
from .workloads import STRUCTURED_WORKLOADS, Workload, get_workload

_S, _I, _N, _B = {"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), "additionalProperties": False}


EXTRACT = [
    ("Ada Lovelace, born in London in 1815, was a mathematician known for her notes on the Analytical Engine.",
     _obj({"name": _S, "birth_year": _I, "city": _S, "occupation": _S})),
    ("The ThinkPad X1 Carbon costs 1899 dollars, weighs 1.12 kg and is in stock.",
     _obj({"product": _S, "price_usd": _N, "weight_kg": _N, "in_stock": _B})),
    ("PyCon US 2024 took place in Pittsburgh from May 15 to May 23 and had about 2500 attendees.",
     _obj({"event": _S, "city": _S, "start": _S, "end": _S, "attendees": _I})),
    ("'The Pragmatic Programmer' by Andrew Hunt and David Thomas was published in 1999 by Addison-Wesley.",
     _obj({"title": _S, "authors": {"type": "array", "items": _S, "maxItems": 4}, "year": _I, "publisher": _S})),
    ("Flight LH 454 leaves Frankfurt at 13:40 and lands in San Francisco at 16:05; seat 32C, economy class.",
     _obj({"flight": _S, "from": _S, "to": _S, "departure": _S, "arrival": _S, "seat": _S,
           "class": {"enum": ["economy", "premium", "business", "first"]}})),
    ("Order 88213: two USB-C cables at 9.99 each and one charger at 24.50, shipped to Lyon, France.",
     _obj({"order_id": _I, "items": {"type": "array", "maxItems": 4, "items": _obj({"name": _S, "quantity": _I,
                                                                                   "unit_price": _N})},
           "city": _S, "country": _S})),
    ("Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911.",
     _obj({"name": _S, "prizes": {"type": "array", "maxItems": 4,
                                  "items": _obj({"field": _S, "year": _I})}})),
    ("The repository leaplm has 3 open issues, 12 contributors and its latest release is 0.1.0.",
     _obj({"repository": _S, "open_issues": _I, "contributors": _I, "latest_release": _S})),
]

TOOLS = [
    ("get_weather(location: string, unit: 'celsius' | 'fahrenheit')", "What's the weather in Paris, in celsius?",
     _obj({"location": _S, "unit": {"enum": ["celsius", "fahrenheit"]}})),
    ("search_flights(origin: string, destination: string, date: string, passengers: integer)",
     "Find me flights from Boston to Denver on 2025-03-14 for two people.",
     _obj({"origin": _S, "destination": _S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
           "passengers": {"type": "integer", "minimum": 1, "maximum": 9}})),
    ("send_email(to: string, subject: string, body: string)", "Email bob@example.com that the build is green.",
     _obj({"to": _S, "subject": _S, "body": {"type": "string", "maxLength": 120}})),
    ("create_event(title: string, start: string, duration_minutes: integer, attendees: string[])",
     "Set up a 30 minute design review tomorrow at 10:00 with Ana and Raj.",
     _obj({"title": _S, "start": _S, "duration_minutes": _I,
           "attendees": {"type": "array", "items": _S, "maxItems": 6}})),
    ("convert_currency(amount: number, from: string, to: string)", "How much is 250 euros in yen?",
     _obj({"amount": _N, "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
           "to": {"type": "string", "pattern": "^[A-Z]{3}$"}})),
    ("run_sql(query: string, limit: integer)", "Show the ten newest users.",
     _obj({"query": {"type": "string", "maxLength": 100}, "limit": _I})),
    ("set_thermostat(room: string, temperature: number, mode: 'heat' | 'cool' | 'auto')",
     "Make the bedroom 21 degrees, heating.",
     _obj({"room": _S, "temperature": _N, "mode": {"enum": ["heat", "cool", "auto"]}})),
    ("translate(text: string, source_language: string, target_language: string)",
     "Translate 'good morning' from English to German.",
     _obj({"text": _S, "source_language": _S, "target_language": _S})),
]


def structured_workload(name: str, n: int) -> Workload:
    """The first n prompts of a structured workload, each with its schema as a constraint."""
    if name == "json-extract":
        items = [(f"Extract the fields below from the text as JSON matching this schema: {json.dumps(schema)}\n"
                  f"Text: {text}\nJSON: ", schema) for text, schema in EXTRACT]
        desc = "extract facts from a sentence as JSON to a schema"
    else:
        items = [(f"You can call the function {sig}. Answer with its arguments as a JSON object.\n"
                  f"Request: {ask}\nArguments: ", schema) for sig, ask, schema in TOOLS]
        desc = "a function call's arguments as JSON to the function's schema"
    items = items[:n]
    return Workload(name, desc, [p for p, _ in items],
                    constraints=[StructuredOutput(json=schema) for _, schema in items])


def any_workload(name: str, n: int) -> Workload:
    """A structured workload or any other (workloads.get_workload)."""
    return structured_workload(name, n) if name in STRUCTURED_WORKLOADS else get_workload(name, n)


def valid(text: str, constraint: StructuredOutput) -> bool:
    """The output opens with a JSON value that validates against the constraint's schema (jsonschema, independent
    of the grammar that constrained it). Text after that value is ignored: an unconstrained run goes on to
    max_new_tokens (benchmarks ignore EOS), a constrained one ends with its value."""
    import jsonschema

    try:
        value, _ = json.JSONDecoder().raw_decode(text.lstrip())
        jsonschema.validate(value, constraint.json)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
