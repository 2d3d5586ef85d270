"""JSON extraction: a JSON-schema grammar and entropic sampling on the same generation.

    python programs/extract.py [--url URL | --engine]

The schema constrains decoding (SGLang's grammar backend masks the logits; the controller sees
the masked distribution), so the output should always parse. Validity is not assumed: each output
is parsed and validated against the schema with jsonschema, and its fields are compared with the
ground truth.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jsonschema
import sglang as sgl

if __package__ in (None, ""):  # `python programs/extract.py`: make the `programs` package importable
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import sgl_entropic
from programs._backend import format_summary, run_from_args, trace_summary

EXTRACTION_PARAMS = {"target_entropy": 0.5}

# Bounded strings and numbers: every value fits in max_tokens, so no output is cut mid-JSON.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z][A-Za-z .'-]{0,29}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "pattern": "^[A-Za-z][A-Za-z .'-]{0,29}$"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

DOCUMENTS = [
    (
        "Maria Lopez is a 34-year-old engineer who lives in Madrid.",
        {"name": "Maria Lopez", "age": 34, "city": "Madrid"},
    ),
    (
        "After retiring at 67, Tom Becker moved to Hamburg to be near his grandchildren.",
        {"name": "Tom Becker", "age": 67, "city": "Hamburg"},
    ),
    ("Yuki Tanaka, 22, studies physics in Osaka.", {"name": "Yuki Tanaka", "age": 22, "city": "Osaka"}),
]


@sgl.function
def extract_person(s, document: str, extraction_params: dict):
    s += sgl.system("Extract the person's name, age and city from the text as JSON.")
    s += sgl.user(document)
    s += sgl.assistant(
        sgl_entropic.gen("record", max_tokens=64, json_schema=json.dumps(PERSON_SCHEMA), **extraction_params)
    )


def check(output: str, expected: dict) -> dict:
    """Parse and validate the output; compare each field with the ground truth."""
    try:
        record = json.loads(output)
        jsonschema.validate(record, PERSON_SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError) as err:
        return {
            "record": None,
            "valid": False,
            "error": f"{type(err).__name__}: {err}".splitlines()[0],
            "fields_correct": 0,
        }
    correct = sum(record[key] == value for key, value in expected.items())
    return {"record": record, "valid": True, "error": None, "fields_correct": correct}


def run(backend, documents=DOCUMENTS, extraction_params: dict = EXTRACTION_PARAMS) -> dict:
    """`extraction_params` are the entropic keywords of the constrained generation (sgl_entropic.gen)."""
    results = []
    for document, expected in documents:
        start = time.perf_counter()
        state = extract_person.run(document=document, extraction_params=extraction_params, backend=backend)
        meta = state.get_meta_info("record")
        results.append(
            {
                "document": document,
                "expected": expected,
                "output": state["record"],
                **check(state["record"], expected),
                "entropy": meta["entropy"],
                "trace": trace_summary(meta),
                "seconds": time.perf_counter() - start,
            }
        )
    return {
        "documents": results,
        "valid_rate": sum(r["valid"] for r in results) / len(results),
        "field_accuracy": sum(r["fields_correct"] for r in results) / sum(len(r["expected"]) for r in results),
    }


def main() -> None:
    result = run_from_args(__doc__, run)
    for item in result["documents"]:
        print(f"\n{item['document']}\n  -> {item['output']}")
        status = "valid" if item["valid"] else f"INVALID ({item['error']})"
        print(f"  {status}, {item['fields_correct']}/{len(item['expected'])} fields correct, {item['seconds']:.1f} s")
        print(f"  [{format_summary(item['trace'])}]")
    print(f"\nvalid JSON: {result['valid_rate']:.0%}, field accuracy: {result['field_accuracy']:.0%}")


if __name__ == "__main__":
    main()
