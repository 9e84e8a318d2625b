"""Extraction prompts for structured outputs (tests/jobs/lines/test_structured_outputs.py, and the contrast
with unconstrained output, ``python benchmarks/extraction.py``): five JSON schemas (a person, a product, an
invoice, a support ticket, an event) and twelve short documents for each, as a user would send
them: a chat message asking for the JSON of a document.

Between them the schemas use what real extraction schemas do: nested objects, enums, arrays with
``minItems``, required fields, bounded numbers and strings with a ``pattern``. Strings and arrays
have a ``maxLength`` / ``maxItems`` so that a complete answer fits the tests' ``max_tokens``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

NAME = {"type": "string", "maxLength": 40}
DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}


def _object(**properties) -> dict:
    """An object schema with every property required and no others allowed."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _array(items: dict, most: int) -> dict:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


SCHEMAS = {
    "person": _object(name=NAME, age=_integer(0, 120), occupation=NAME, location=_object(city=NAME, country=NAME)),
    "product": _object(name=NAME, price={"type": "number", "minimum": 0, "maximum": 100000},
                       currency={"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
                       in_stock={"type": "boolean"}, tags=_array({"type": "string", "maxLength": 20}, 3)),
    "invoice": _object(invoice_number={"type": "string", "pattern": "^INV-[0-9]{4}$"}, date=DATE, customer=NAME,
                       total={"type": "number", "minimum": 0, "maximum": 1000000},
                       items=_array(_object(description=NAME, quantity=_integer(1, 1000)), 3)),
    "ticket": _object(priority={"type": "string", "enum": ["low", "medium", "high", "urgent"]},
                      category={"type": "string", "enum": ["billing", "technical", "account", "shipping"]},
                      summary={"type": "string", "maxLength": 60},
                      customer=_object(name=NAME, email={"type": "string",
                                                         "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,3}$"})),
    "event": _object(title=NAME, date=DATE, city=NAME, attendees=_integer(1, 100000), speakers=_array(NAME, 3)),
}

DOCUMENTS = {
    "person": [
        "Maria Lopez, 34, works as a pediatric nurse in Madrid, Spain.",
        "Born in 1961, Kenji Watanabe (now 63) is a retired train engineer living in Osaka, Japan.",
        "Our new hire, Tom Becker, is a 28-year-old data analyst based in Berlin, Germany.",
        "Aisha Bello is a 45-year-old architect. She lives and works in Lagos, Nigeria.",
        "At 19, Liam O'Connor is the youngest barista at the cafe; he lives in Dublin, Ireland.",
        "Dr. Priya Raman, 52, is a cardiologist at a hospital in Chennai, India.",
        "Lucas Martin (41) teaches high-school chemistry in Lyon, France.",
        "Sofia Rossi is a 30-year-old software developer from Milan, Italy.",
        "Retired pilot Henry Walker, aged 70, now lives in Toronto, Canada.",
        "Emma Johansson, a 26-year-old graphic designer, moved to Stockholm, Sweden last year.",
        "Carlos Mendes, 38, is a chef who runs a small restaurant in Lisbon, Portugal.",
        "Ngozi Okafor is a 33-year-old lawyer practising in Abuja, Nigeria.",
    ],
    "product": [
        "The AeroPress Go coffee maker sells for $39.95. In stock now. Great for travel and camping.",
        "Sony WH-1000XM5 headphones: 349 EUR, currently out of stock. Wireless, noise cancelling.",
        "Kindle Paperwhite, 16 GB, priced at 139.99 USD and available to ship today. E-reader.",
        "Handmade ceramic mug, 18 GBP. Only a few left in stock. Kitchen, gift.",
        "LEGO Botanical Bonsai Tree set, $49.99, sold out until next month. Toys, plants.",
        "Logitech MX Master 3S mouse for 99 EUR, in stock. Office, wireless.",
        "Uniqlo Ultra Light Down Jacket, 59.90 GBP, available in all sizes. Clothing, winter.",
        "Nintendo Switch OLED console, 37980 JPY, back in stock. Gaming.",
        "Yeti Rambler 20 oz tumbler, $35, in stock. Outdoors, drinkware.",
        "Moleskine Classic Notebook, large, 22.50 EUR. Currently unavailable. Stationery.",
        "Philips Hue starter kit with three bulbs, 129.99 USD, in stock. Smart home, lighting.",
        "Le Creuset cast iron casserole, 265 GBP, in stock. Cookware, kitchen.",
    ],
    "invoice": [
        "Invoice INV-0042 dated 2024-03-15 for Acme Corp: 3 laptops and 5 docking stations. Total 4250.00.",
        "INV-1187, issued 2023-11-02 to Blue River Cafe. 20 bags of coffee beans. Amount due: 360.",
        "Billing document INV-0503 (2024-01-20), customer: Northwind Traders, 2 office chairs. Total: 598.",
        "Invoice number INV-7781. Date: 2022-07-09. Bill to: Sunrise Dental. 1 x-ray sensor. Total 7200.",
        "INV-0009 from 2024-05-01 for Greenleaf Landscaping: 10 shovels, 4 wheelbarrows, total 890.50.",
        "Our invoice INV-3310, dated 2023-09-28, to Orion Labs covers 100 test kits. Total due 1500.",
        "Invoice INV-2024 (2024-02-29) billed to Maple Bakery: 6 mixing bowls and 1 oven. Total 2300.",
        "INV-0777, 2021-12-24, Customer: Polar Express Ltd, 50 train tickets, total 2500.",
        "Invoice INV-4100 issued on 2024-06-10 to City Library for 200 books. Total: 3980.",
        "Ref INV-0615, date 2023-06-15, client Harbor Freight Co, 12 pallets. Grand total 1140.",
        "Invoice INV-9001 dated 2024-04-04 for Nova Gym: 8 kettlebells and 2 treadmills. Total 5120.",
        "INV-0350 on 2022-10-31 to Pumpkin Patch Farm: 300 pumpkins. Total amount 900.",
    ],
    "ticket": [
        "From: jane.doe@mail.com (Jane Doe). I was charged twice for my subscription this month! Please refund.",
        "Hi, this is Mark Chen (mark.chen@corp.io). The app crashes every time I open settings. Urgent, "
        "our whole team is blocked.",
        "Samir Haddad, samir@post.net: I forgot my password and the reset email never arrives.",
        "My parcel has not arrived after three weeks. - Olga Petrova, olga.p@mail.ru",
        "Customer Lisa Wong (lisa.wong@shop.com) asks how to change the email address on her account. "
        "Not urgent.",
        "URGENT from peter.smith@bank.co (Peter Smith): the payment API returns error 500 for all requests.",
        "Anna Kowalska, anna.k@poczta.pl: the invoice shows the wrong VAT rate, please correct it.",
        "David Kim (dkim@startup.io) reports that the dashboard loads slowly in the afternoons.",
        "Package arrived damaged, the box was crushed. Fatima Zahra, fatima.z@mail.ma",
        "Please close my account and delete my data. Regards, Hans Muller, hans.muller@web.de",
        "Rahul Verma (rahul.v@mail.in): the export to CSV button does nothing in Firefox.",
        "Elena Garcia, elena.garcia@mail.es: my order was shipped to my old address, can you redirect it?",
    ],
    "event": [
        "PyCon US 2024 takes place on 2024-05-15 in Pittsburgh, with about 2500 attendees. Keynote by "
        "Jay Miller.",
        "The Berlin Marathon Expo opens 2023-09-22 in Berlin; 40000 visitors expected. Speakers: Eliud "
        "Kipchoge, Amy Reed.",
        "Join us for the Data Science Meetup on 2024-02-08 in Austin. 80 people have signed up. Talk by "
        "Laura Chen.",
        "The Annual Jazz Night is on 2023-12-01 in New Orleans, featuring Wynton Marsalis, for 1200 guests.",
        "RustConf 2024 happens 2024-09-10 in Montreal with 900 attendees; speakers include Nell Shamrell.",
        "Town hall meeting on 2024-03-03 in Springfield. Expected attendance 150. Mayor Joe Quimby will speak.",
        "The Kyoto Tea Ceremony Workshop, 2024-04-12, Kyoto, limited to 20 participants, led by Sen Soshitsu.",
        "Web Summit 2023 was held on 2023-11-13 in Lisbon with 70000 attendees. Speakers: Paddy Cosgrave, "
        "Kara Swisher.",
        "Charity gala on 2024-06-21 in London for 300 guests, hosted by Stephen Fry.",
        "The Robotics Olympiad final is on 2024-07-19 in Seoul; 500 students compete. Opening talk by Dennis Hong.",
        "Open-air cinema night, 2024-08-02, in Vienna, 400 seats, introduced by director Ruth Beckermann.",
        "The Nordic Startup Forum runs 2024-10-05 in Helsinki for 3000 people. Speakers: Linda Liukas.",
    ],
}


def extraction_prompt(kind: str, document: str) -> str:
    return (f"Extract the {kind} described below as JSON with the fields "
            f"{', '.join(SCHEMAS[kind]['properties'])}.\n\n{document}\n\nAnswer with the JSON only.")


def cases() -> list[tuple[str, str]]:
    """(kind, document) for every document, in a fixed order."""
    return [(kind, doc) for kind, docs in DOCUMENTS.items() for doc in docs]


MAX_TOKENS = 120


def extraction_line(i: int, kind: str, document: str, model: str, constrained: bool) -> str:
    """A request line asking for the JSON of ``document``, with its schema as ``response_format`` or not."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": extraction_prompt(kind, document)}]}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind],
                                                                          "strict": True}}
    return json.dumps({"custom_id": f"{kind}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def run_extractions(folder: Path, engine, name: str, constrained: bool,
                    every: int = 1) -> list[tuple[str, str, str]]:
    """Every case (``every``: each every-th, from the first) through ``berth generate`` on ``engine``:
    (kind, finish_reason, text), in order."""
    from jobs.hosting.generate import generate_file

    chosen = cases()[::every]
    path = folder / f"{name}.jsonl"
    path.write_text("".join(extraction_line(i, kind, doc, engine.model_name, constrained) + "\n"
                            for i, (kind, doc) in enumerate(chosen)))
    summary = generate_file(path, folder / f"{name}.out.jsonl", engine=engine, progress=False)
    assert (summary.completed, summary.failed) == (len(chosen), 0), summary
    out = []
    for (kind, _), line in zip(chosen, (folder / f"{name}.out.jsonl").read_text().splitlines()):
        [choice] = json.loads(line)["response"]["body"]["choices"]
        out.append((kind, choice["finish_reason"], choice["message"]["content"]))
    return out


def invalid(kind: str, text: str) -> str | None:
    """Why ``text`` is not a JSON value valid against the kind's schema, or None."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc})"
    errors = list(jsonschema.Draft202012Validator(SCHEMAS[kind]).iter_errors(value))
    return f"invalid: {errors[0].message}" if errors else None


def main() -> None:
    """The same prompts with and without the constraint, on the defaults: how many outputs stop,
    parse and validate, and what each run took."""
    import tempfile

    from benchmarks.machine import machine_info, machine_line
    from worker.config import Settings
    from worker.engine.engine import Engine

    engine = Engine(Settings())
    print(f"{len(cases())} extraction prompts over {len(SCHEMAS)} schemas, max_tokens {MAX_TOKENS}, "
          f"on {machine_line(machine_info(engine.settings.resolved_threads()))}")
    print(f"{'run':<14}{'stop':>6}{'parse':>7}{'valid':>7}{'seconds':>9}")
    with tempfile.TemporaryDirectory() as folder:
        for name, constrained in (("constrained", True), ("unconstrained", False)):
            t0 = time.perf_counter()
            results = run_extractions(Path(folder), engine, name, constrained)
            seconds = time.perf_counter() - t0
            stop = sum(reason == "stop" for _, reason, _ in results)
            parse = sum(not (invalid(k, t) or "").startswith("not JSON") for k, _, t in results)
            valid = sum(invalid(k, t) is None for k, _, t in results)
            print(f"{name:<14}{stop:>6}{parse:>7}{valid:>7}{seconds:>9.1f}")


if __name__ == "__main__":
    main()
