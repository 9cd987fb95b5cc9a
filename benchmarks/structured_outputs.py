"""Structured outputs with and without speculation on the default model: 20 JSON-schema requests (written for
specserve, general topics), greedy, 128 tokens, plain decoding vs speculation (n-gram by default; each of
--methods) on the same constrained requests, and the first method on the same prompts without a guide for the
acceptance it has there.

    python benchmarks/structured_outputs.py [--num-prompts 20] [--max-tokens 128] [--max-draft-len 4]
        [--methods ngram,suffix] [--tools required|named] [--json out.json]

`--tools`: each schema is instead the parameters of a function `record` the chat template is shown, called with
OpenAI's `tool_choice` `required` (a JSON array of calls) or named (the arguments alone), as the server decodes it.

Reports per run: output tokens/s, acceptance rate and length (tokens per target forward), the share of outputs that
are valid JSON matching their schema (a run cut by max_tokens is not), and whether the speculative outputs equal
the plain ones token for token. The schema check (`matches`) covers the keywords these schemas use.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from specserve.config import DeploymentConfig, SpeculativeConfig, build_engine
from specserve.server.openai.tools import parse_tools
from specserve.speculative.grammar import Guide
from specserve.speculative.sampling import SamplingParams

# bounded as a real API's schema would be: a small greedy model can otherwise write digits, a string or list items
# until max_tokens (the output is then cut, finish_reason "length")
S = {"type": "string", "maxLength": 80}
I = {"type": "integer", "minimum": -10**10, "maximum": 10**10}
N = {"type": "number", "minimum": -10**6, "maximum": 10**6}
B = {"type": "boolean"}


def obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def strings() -> dict:
    return {"type": "array", "items": S, "maxItems": 6}


CASES = [
    ("Describe a city as JSON with name, country and population.", obj(name=S, country=S, population=I)),
    ("Describe a book as JSON with title, author, year and genres.", obj(title=S, author=S, year=I, genres=strings())),
    ("Give a recipe for pancakes as JSON with name, servings, ingredients and steps.",
     obj(name=S, servings=I, ingredients=strings(), steps=strings())),
    ("Describe a planet of the solar system as JSON with name, moons and whether it has rings.",
     obj(name=S, moons=I, has_rings=B)),
    ("Describe a famous painting as JSON with title, painter and year.", obj(title=S, painter=S, year=I)),
    ("Describe an animal as JSON with name, habitat, diet and average weight in kilograms.",
     obj(name=S, habitat=S, diet={"enum": ["herbivore", "carnivore", "omnivore"]}, weight_kg=N)),
    ("Describe a country as JSON with name, capital, continent and languages.",
     obj(name=S, capital=S, continent=S, languages=strings())),
    ("Describe a movie as JSON with title, director, year and rating out of 10.",
     obj(title=S, director=S, year=I, rating=N)),
    ("Describe a programming language as JSON with name, year created, creator and typing.",
     obj(name=S, year=I, creator=S, typing={"enum": ["static", "dynamic"]})),
    ("Describe a mountain as JSON with name, country and height in meters.", obj(name=S, country=S, height_m=I)),
    ("Give a weather report as JSON with city, temperature in Celsius, conditions and whether it will rain.",
     obj(city=S, temperature_c=N, conditions=S, rain=B)),
    ("Describe a person as JSON with name, age, occupation and hobbies.",
     obj(name=S, age=I, occupation=S, hobbies=strings())),
    ("Describe a car as JSON with make, model, year and fuel type.",
     obj(make=S, model=S, year=I, fuel={"enum": ["petrol", "diesel", "electric", "hybrid"]})),
    ("Describe a sport as JSON with name, players per team and whether it uses a ball.",
     obj(name=S, players_per_team=I, uses_ball=B)),
    ("Describe a river as JSON with name, length in kilometers and the countries it flows through.",
     obj(name=S, length_km=I, countries=strings())),
    ("Describe a musical instrument as JSON with name, family and origin.",
     obj(name=S, family={"enum": ["string", "wind", "percussion", "keyboard"]}, origin=S)),
    ("Give a product for an online shop as JSON with name, price, currency and stock.",
     obj(name=S, price=N, currency=S, in_stock=B)),
    ("Describe a historical event as JSON with name, year and place.", obj(name=S, year=I, place=S)),
    ("Describe a university course as JSON with title, credits and topics.",
     obj(title=S, credits=I, topics=strings())),
    ("Describe a restaurant as JSON with name, cuisine, rating and address.",
     obj(name=S, cuisine=S, rating=N, address=obj(street=S, city=S))),
]


def matches(value, schema: dict) -> bool:
    """Whether `value` matches `schema` (type, enum, properties, required, additionalProperties, items, minimum,
    maximum, maxLength)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or not set(schema.get("required", [])) <= set(value):
            return False
        properties = schema.get("properties", {})
        if schema.get("additionalProperties") is False and not set(value) <= set(properties):
            return False
        return all(matches(value[key], properties[key]) for key in value if key in properties)
    if kind == "array":
        return isinstance(value, list) and all(matches(item, schema.get("items", {})) for item in value)
    checks = {"string": lambda v: isinstance(v, str) and len(v) <= schema.get("maxLength", len(v)),
              "boolean": lambda v: isinstance(v, bool),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) and in_range(v, schema),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and in_range(v, schema)}
    return checks[kind](value) if kind in checks else True


def in_range(value, schema: dict) -> bool:
    return schema.get("minimum", value) <= value <= schema.get("maximum", value)


def prompt_ids(engine, text: str, tools: list[dict] | None = None) -> list[int]:
    """The request as a chat turn in the model's chat format (the embedded default: specserve's question-and-answer
    format, models/chat_template.py), as the server's chat route renders it."""
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True, **({"tools": tools} if tools else {}))
        return tokenizer(rendered, add_special_tokens=False).input_ids
    return engine.encode(text)


def tool_request(schema: dict, choice: str):
    """A one-function tool request whose parameters are `schema`, called as OpenAI's `tool_choice` says."""
    tools = [{"type": "function", "function": {"name": "record", "description": "Record the answer.",
                                               "parameters": schema}}]
    named = {"type": "function", "function": {"name": "record"}}
    return parse_tools({"tools": tools, "tool_choice": named if choice == "named" else choice}, None, None)


def request(engine, text: str, schema: dict, guided: bool, tools: str | None):
    """(prompt ids, guide, the output -> its JSON value) of one case."""
    if tools is None:
        return prompt_ids(engine, text), Guide("json_schema", schema) if guided else None, json.loads
    calls = tool_request(schema, tools)

    def arguments(output: str):
        message, _ = calls.output().message(output, "stop")
        return json.loads(message["tool_calls"][0]["function"]["arguments"])  # KeyError: no call

    return prompt_ids(engine, text, calls.template_tools()), calls.guide() if guided else None, arguments


def run(engine, cases, max_tokens: int, guided: bool, tools: str | None = None) -> dict:
    ids, guide, _ = request(engine, *cases[0], guided, tools)
    engine.generate(ids, SamplingParams(max_tokens=max_tokens, guide=guide))  # untimed: kernels, grammar vocabulary
    if engine.method is not None:
        engine.method.reset()  # a method that learns across requests (suffix) must not draft from the warm-up
    outputs, valid, tokens, seconds, drafted, accepted, forwards = [], 0, 0, 0.0, 0, 0, 0
    for text, schema in cases:
        ids, guide, value = request(engine, text, schema, guided, tools)
        params = SamplingParams(max_tokens=max_tokens, guide=guide,
                                stop=list(engine.target.chat_stop))  # as the server's chat route sets it
        start = time.perf_counter()
        result = engine.generate(ids, params)
        seconds += time.perf_counter() - start
        m = result.metrics
        outputs.append(result.token_ids)
        tokens, drafted, accepted = tokens + m.output_tokens, drafted + m.total_draft_tokens, \
            accepted + m.total_accepted_draft_tokens
        forwards += m.target_forwards
        try:
            valid += matches(value(result.text), schema)
        except (ValueError, KeyError, IndexError):
            pass
    return {"tokens_per_s": round(tokens / seconds, 2), "output_tokens": tokens,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "acceptance_length": round(tokens / forwards, 3) if forwards else None,
            "valid_json_matching_schema": round(valid / len(cases), 4), "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=len(CASES))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-draft-len", type=int, default=4)
    parser.add_argument("--methods", default="ngram", help="comma-separated speculative methods run guided")
    parser.add_argument("--tools", choices=["required", "named"], help="ask for each schema as a tool call")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    cases = CASES[: args.num_prompts]
    base = DeploymentConfig()
    target = base.model.load()
    engines = {name: build_engine(replace(base, speculative=SpeculativeConfig(name, args.max_draft_len)), target)
               for name in args.methods.split(",")}
    runs = {"ar+json_schema": run(build_engine(base, target), cases, args.max_tokens, True, args.tools)}
    for name, engine in engines.items():
        runs[f"{name}+json_schema"] = run(engine, cases, args.max_tokens, True, args.tools)
    first = next(iter(engines))
    runs[f"{first} (no guide)"] = run(engines[first], cases, args.max_tokens, False, args.tools)
    reference = runs["ar+json_schema"]["outputs"]
    summary = {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in runs.items()}
    for name in engines:
        key = f"{name}+json_schema"
        equal = [a == b for a, b in zip(runs[key]["outputs"], reference)]
        summary[key]["outputs_equal_ar"] = f"{sum(equal)}/{len(equal)}"
        summary[key]["speedup_vs_ar"] = round(runs[key]["tokens_per_s"] / runs["ar+json_schema"]["tokens_per_s"], 3)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)


if __name__ == "__main__":
    main()
