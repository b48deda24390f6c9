"""Write the demo datasets under data/ (deterministic, stdlib only, no network).

    python scripts/make_demo_data.py [--out data] [--seed 0]

Every row is generated here from small hand-written lists and templates: short factual answers,
arithmetic, rewriting, lists, word translations, about 15% in Chinese. Answers follow one fixed style per
task so a short LoRA SFT run measurably lowers eval loss, and the rejected side of each preference pair is
worse in one systematic way (wrong number, off-topic, rude, or cut off) so a reward model can learn it.
`demo_tools_sft` solves word problems with a calculator tool call; it avoids the problems of `demo_math` and of
the held-out set scripts/make_math_eval.py draws from them (computed here with that script's defaults).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Canada", "Ottawa"),
            ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Chile", "Santiago"),
            ("Ireland", "Dublin"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Mexico", "Mexico City"),
            ("Germany", "Berlin"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Cuba", "Havana"),
            ("Argentina", "Buenos Aires"), ("Australia", "Canberra"), ("India", "New Delhi")]
CAPITALS_ZH = [("法国", "巴黎"), ("日本", "东京"), ("意大利", "罗马"), ("西班牙", "马德里"), ("加拿大", "渥太华"),
               ("埃及", "开罗"), ("德国", "柏林"), ("俄罗斯", "莫斯科"), ("英国", "伦敦"), ("韩国", "首尔"),
               ("泰国", "曼谷"), ("澳大利亚", "堪培拉")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("early", "late"),
             ("open", "closed"), ("light", "dark"), ("full", "empty"), ("strong", "weak"), ("old", "young"),
             ("high", "low"), ("wet", "dry"), ("loud", "quiet"), ("rich", "poor"), ("hard", "soft")]
OPPOSITES_ZH = [("大", "小"), ("高", "低"), ("快", "慢"), ("冷", "热"), ("多", "少"), ("长", "短"), ("早", "晚")]
PAST_TENSE = [("I walk to school.", "I walked to school."), ("She plays the piano.", "She played the piano."),
              ("We cook dinner together.", "We cooked dinner together."), ("He writes a letter.", "He wrote a letter."),
              ("They swim in the lake.", "They swam in the lake."), ("The dog runs in the park.", "The dog ran in the park."),
              ("I read a long book about the history of the sea.", "I read a long book about the history of the sea."),
              ("The children sing a song.", "The children sang a song."), ("She buys fresh bread.", "She bought fresh bread."),
              ("My brother drives to work every morning.", "My brother drove to work every morning."),
              ("The train leaves at noon.", "The train left at noon."), ("We watch the stars at night.", "We watched the stars at night."),
              ("He eats an apple and drinks some water before the long walk home.",
               "He ate an apple and drank some water before the long walk home.")]
CATEGORIES = {"fruits": ["apple", "banana", "cherry", "mango", "pear", "grape", "peach", "plum"],
              "colours": ["red", "blue", "green", "yellow", "purple", "orange", "white"],
              "animals": ["cat", "dog", "horse", "rabbit", "tiger", "elephant", "owl", "fox"],
              "vegetables": ["carrot", "potato", "onion", "pepper", "cabbage", "pea", "leek"],
              "planets": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
              "musical instruments": ["piano", "violin", "guitar", "flute", "drum", "trumpet", "cello"]}
FRENCH = [("good morning", "bonjour"), ("thank you", "merci"), ("cat", "chat"), ("dog", "chien"), ("house", "maison"),
          ("water", "eau"), ("bread", "pain"), ("book", "livre"), ("friend", "ami"), ("sun", "soleil"),
          ("moon", "lune"), ("tree", "arbre"), ("car", "voiture"), ("school", "école"), ("apple", "pomme")]
PHRASES = ["the quick brown fox", "good night and sleep well", "a cup of tea", "rain in the mountains",
           "open the window please", "the library closes at six", "three small boats on the river",
           "learning is a lifelong journey that never really ends"]
SYSTEMS = ["You are a concise assistant. Answer in one sentence.", "You are a helpful assistant.",
           "Answer briefly and correctly.", "You are a friendly tutor who answers in plain words."]
NAMES = ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Lena", "Kofi", "Yuki", "Ben", "Nora"]
NAMES_ZH = ["小明", "小红", "小刚", "小丽", "王芳", "李雷"]
OFF_TOPIC = ["I really like the colour of autumn leaves.", "Bananas are a good source of potassium.",
             "My favourite film is about a lighthouse keeper.", "The weather was nice last Tuesday.",
             "Cats sleep for most of the day.", "Trains are a relaxing way to travel."]
RUDE = ["Figure it out yourself.", "That is a stupid question.", "Why would I tell you?", "Stop asking me things.",
        "Look it up, I'm busy."]
RUDE_ZH = ["自己去查。", "这个问题太蠢了。", "别问我。"]
OFF_TOPIC_ZH = ["我喜欢秋天的树叶。", "猫一天大部分时间都在睡觉。"]


def _qa_english(rng: random.Random) -> dict:
    """One English instruction/input/output row from a randomly chosen task; `kind` says which."""
    task = rng.choice(["capital", "add", "multiply", "subtract", "rewrite", "list", "translate", "opposite",
                       "upper", "words", "minutes"])
    if task == "capital":
        country, capital = rng.choice(CAPITALS)
        return dict(kind="fact", instruction=f"What is the capital of {country}?", input="",
                    output=f"The capital of {country} is {capital}.")
    if task in ("add", "multiply", "subtract"):
        a, b = rng.randint(2, 99 if task != "multiply" else 12), rng.randint(2, 99 if task != "multiply" else 12)
        if task == "subtract" and b > a:
            a, b = b, a
        op, value = {"add": ("plus", a + b), "multiply": ("times", a * b), "subtract": ("minus", a - b)}[task]
        return dict(kind="math", instruction=f"What is {a} {op} {b}?", input="", output=f"{a} {op} {b} is {value}.",
                    value=value)
    if task == "rewrite":
        present, past = rng.choice(PAST_TENSE)
        return dict(kind="rewrite", instruction="Rewrite the sentence in the past tense.", input=present, output=past)
    if task == "list":
        category, items = rng.choice(list(CATEGORIES.items()))
        n = rng.randint(2, 5)
        picked = rng.sample(items, n)
        return dict(kind="list", instruction=f"List {n} {category}.", input="",
                    output=f"Here are {n} {category}: {', '.join(picked[:-1])} and {picked[-1]}.")
    if task == "translate":
        english, french = rng.choice(FRENCH)
        return dict(kind="translate", instruction="Translate the phrase into French.", input=english,
                    output=f'"{english}" in French is "{french}".')
    if task == "opposite":
        word, opposite = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            word, opposite = opposite, word
        return dict(kind="fact", instruction=f"What is the opposite of \"{word}\"?", input="",
                    output=f"The opposite of \"{word}\" is \"{opposite}\".")
    if task == "upper":
        phrase = rng.choice(PHRASES)
        return dict(kind="rewrite", instruction="Convert the text to uppercase.", input=phrase, output=phrase.upper())
    if task == "words":
        sentence = rng.choice([p for _, p in PAST_TENSE] + [p.capitalize() + "." for p in PHRASES])
        n = len(sentence.split())
        return dict(kind="math", instruction="How many words are in this sentence?", input=sentence,
                    output=f"The sentence has {n} words.", value=n)
    hours = rng.randint(2, 24)
    return dict(kind="math", instruction=f"How many minutes are in {hours} hours?", input="",
                output=f"{hours} hours is {hours * 60} minutes.", value=hours * 60)


def _qa_chinese(rng: random.Random) -> dict:
    task = rng.choice(["capital", "add", "opposite"])
    if task == "capital":
        country, capital = rng.choice(CAPITALS_ZH)
        return dict(kind="fact", instruction=f"{country}的首都是哪里？", input="", output=f"{country}的首都是{capital}。")
    if task == "add":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return dict(kind="math", instruction=f"{a}加{b}等于多少？", input="", output=f"{a}加{b}等于{a + b}。", value=a + b)
    word, opposite = rng.choice(OPPOSITES_ZH)
    return dict(kind="fact", instruction=f"“{word}”的反义词是什么？", input="", output=f"“{word}”的反义词是“{opposite}”。")


def _qa(rng: random.Random) -> dict:
    row = _qa_chinese(rng) if rng.random() < 0.15 else _qa_english(rng)
    row["zh"] = any("\u4e00" <= ch <= "\u9fff" for ch in row["instruction"])
    return row


def _public(row: dict, keys=("instruction", "input", "output")) -> dict:
    return {k: row[k] for k in keys if k in row}


def _unique(make_row, n: int, key) -> list[dict]:
    """n rows from `make_row()`, none repeating `key(row)`: repeated prompts would let a held-out split
    measure memorisation instead of learning."""
    rows, seen = [], set()
    while len(rows) < n:
        row = make_row()
        if row is not None and key(row) not in seen:
            seen.add(key(row))
            rows.append(row)
    return rows


def _prompt_key(row: dict) -> tuple:
    return row.get("instruction"), row.get("input"), row.get("prompt"), row.get("text")


def make_sft(rng: random.Random, n: int = 300) -> list[dict]:
    def row() -> dict:
        out = _public(_qa(rng))
        if rng.random() < 0.1:
            out["system"] = rng.choice(SYSTEMS)
        return out

    return _unique(row, n, _prompt_key)


def make_sharegpt(rng: random.Random, n: int = 100) -> list[dict]:
    rows = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(1, 4)):
            qa = _qa(rng)
            question = qa["instruction"] + (("\n" + qa["input"]) if qa["input"] else "")
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": qa["output"]}]
        row = {"conversations": turns}
        if rng.random() < 0.3:
            row["system"] = rng.choice(SYSTEMS)
        rows.append(row)
    return rows


def _rejected(rng: random.Random, qa: dict) -> str:
    """A systematically worse answer: wrong number, off-topic, rude, or cut off mid-sentence."""
    flaws = ["off_topic", "rude", "truncated"] + (["wrong"] * 2 if "value" in qa else [])
    flaw = rng.choice(flaws)
    if flaw == "wrong":
        value = qa["value"]
        wrong = value + rng.choice([-1, 1]) * rng.randint(1, max(2, value // 3 + 1))
        head, _, tail = qa["output"].rpartition(str(value))  # the result is the last number written
        return head + str(wrong) + tail
    if flaw == "off_topic":
        return rng.choice(OFF_TOPIC_ZH if qa["zh"] else OFF_TOPIC)
    if flaw == "rude":
        return rng.choice(RUDE_ZH if qa["zh"] else RUDE)
    text = qa["output"]
    cut = max(1, len(text) // 3) if qa["zh"] or " " not in text else len(" ".join(text.split()[: max(1, len(text.split()) // 3)]))
    return text[:cut].rstrip(" ,.") + ("..." if not qa["zh"] else "")


def make_pref(rng: random.Random, n: int = 300) -> list[dict]:
    def row() -> dict | None:
        qa = _qa(rng)
        rejected = _rejected(rng, qa)
        if rejected == qa["output"]:
            return None
        return {"instruction": qa["instruction"], "input": qa["input"], "chosen": qa["output"], "rejected": rejected}

    return _unique(row, n, _prompt_key)


def make_kto(rng: random.Random, n: int = 300) -> list[dict]:
    """Unpaired KTO rows in LLaMA-Factory's kto_en_demo shape (`messages` + boolean `label`): each preference
    pair gives one reply, the good one (desirable) for about 60% of prompts, so the two kinds are unbalanced."""
    rows = []
    for pair in make_pref(rng, n):
        desirable = rng.random() < 0.6
        prompt = "\n".join(part for part in (pair["instruction"], pair["input"]) if part)
        rows.append({"messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": pair["chosen" if desirable else "rejected"]}],
                     "label": desirable})
    return rows


MATH_TEMPLATES = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", lambda a, b: a + b),
    ("A shelf holds {a} books. {name} takes {b} of them away. How many books are left on the shelf?",
     lambda a, b: a - b),
    ("{name} buys {a} boxes of pencils with {b} pencils in each box. How many pencils is that in total?",
     lambda a, b: a * b),
    ("{name} shares {a} sweets equally among {b} friends. How many sweets does each friend get?",
     lambda a, b: a // b),
    ("A bus has {a} passengers. At the next stop {b} people get on and 3 get off. How many passengers are on "
     "the bus now?", lambda a, b: a + b - 3),
    ("{name} reads {a} pages every day for {b} days, then reads 10 more pages. How many pages has {name} read?",
     lambda a, b: a * b + 10),
]
MATH_TEMPLATES_ZH = [
    ("{name}有{a}个苹果，又买了{b}个。{name}现在有多少个苹果？", lambda a, b: a + b),
    ("{name}每天跑{a}公里，跑了{b}天。{name}一共跑了多少公里？", lambda a, b: a * b),
]


def make_math(rng: random.Random, n: int = 300) -> list[dict]:
    return _unique(lambda: _math_row(rng), n, _prompt_key)


def _math_row(rng: random.Random) -> dict:
    return _math_problem(rng)[0]


def _math_problem(rng: random.Random) -> tuple[dict, str, int, int]:
    """A word problem row (`prompt`, `answer`) with the template and the two numbers it was written from."""
    zh = rng.random() < 0.15
    template, solve = rng.choice(MATH_TEMPLATES_ZH if zh else MATH_TEMPLATES)
    a, b = rng.randint(4, 60), rng.randint(2, 12)
    if "sweets" in template:
        a = b * rng.randint(2, 9)  # divisions come out whole
    if "takes" in template and b > a:
        a, b = b, a
    name = rng.choice(NAMES_ZH if zh else NAMES)
    return {"prompt": template.format(name=name, a=a, b=b), "answer": str(solve(a, b))}, template, a, b


# The tool-use SFT set (`demo_tools_sft`): the same word problems, solved by calling the calculator of
# examples/tools/calculator.py, so a short SFT run teaches the call format before GRPO with tools
# (examples/sft_tools_lora.yaml, then examples/grpo_tools_lora.yaml). Each row: the problem; an assistant turn that
# is only the call; the tool's result; the answer. The schema is the one the GRPO prompt shows (transformers'
# `get_json_schema` of `calculate`, checked by tests/unit/test_demo_tools_sft.py), so the SFT prompt and the RL
# prompt are the same text. The expression of each problem family, in the order of MATH_TEMPLATES(_ZH):
CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression and return the result.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": 'numbers with + - * / // % ** and parentheses, e.g. "12 * (3 + 4)".'}},
        "required": ["expression"]},
    "return": {"type": "string"}}}
MATH_EXPRESSIONS = ["{a} + {b}", "{a} - {b}", "{a} * {b}", "{a} / {b}", "{a} + {b} - 3", "{a} * {b} + 10"]
MATH_EXPRESSIONS_ZH = ["{a} + {b}", "{a} * {b}"]
# make_math_eval.py's defaults: the held-out problems the tool set must not contain.
MATH_EVAL_ROWS, MATH_EVAL_SEED = 100, 12


def _math_eval_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_math_eval", Path(__file__).with_name("make_math_eval.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tools_sft(rng: random.Random, n: int, math_rows: list[dict]) -> list[dict]:
    """`n` tool-use conversations (sharegpt, LLaMA-Factory's `function_call`/`observation` turns) on word problems
    that are in neither `math_rows` (GRPO's) nor the held-out set make_math_eval.py draws from them (a problem is its
    prompt with the name blanked, as there)."""
    math_eval = _math_eval_script()
    held_out = math_eval.make_eval_rows(math_rows, MATH_EVAL_ROWS, MATH_EVAL_SEED)
    seen = {math_eval.problem_key(row["prompt"]) for row in math_rows + held_out}
    tools = json.dumps([CALCULATOR_SCHEMA], ensure_ascii=False)
    expressions = dict(zip([t for t, _ in MATH_TEMPLATES + MATH_TEMPLATES_ZH], MATH_EXPRESSIONS + MATH_EXPRESSIONS_ZH))
    rows = []
    while len(rows) < n:
        row, template, a, b = _math_problem(rng)
        key = math_eval.problem_key(row["prompt"])
        if key in seen:
            continue
        seen.add(key)
        expression = expressions[template].format(a=a, b=b)
        zh = not row["prompt"].isascii()
        answer = row["answer"]
        rows.append({"conversations": [
            {"from": "human", "value": row["prompt"]},
            {"from": "function_call", "value": json.dumps({"name": "calculate", "arguments": {"expression": expression}})},
            {"from": "observation", "value": answer},
            {"from": "gpt", "value": f"答案是{answer}。" if zh else f"The answer is {answer}."}],
            "tools": tools})
    return rows


ANIMAL_FACTS = [("owl", "bird", "forests", "mice and insects", "hunts at night"),
                ("dolphin", "mammal", "the sea", "fish", "lives in groups called pods"),
                ("camel", "mammal", "deserts", "dry plants", "can go for days without water"),
                ("frog", "amphibian", "ponds", "insects", "starts life as a tadpole"),
                ("penguin", "bird", "cold southern coasts", "fish and krill", "cannot fly but swims well"),
                ("bee", "insect", "meadows", "nectar", "makes honey in a hive")]
CITY_FACTS = [("Paris", "France", "the Seine"), ("Rome", "Italy", "the Tiber"), ("Cairo", "Egypt", "the Nile"),
              ("London", "England", "the Thames"), ("Vienna", "Austria", "the Danube")]
EXTRA_SENTENCES = ["Many people visit it every year.", "Scientists still study it closely.",
                   "Children often learn about it at school.", "It appears in many old stories.",
                   "Its numbers have changed over the last century.", "Pictures of it are easy to find."]


def make_pt(rng: random.Random, n: int = 200) -> list[dict]:
    return _unique(lambda: _pt_row(rng), n, _prompt_key)


def _pt_row(rng: random.Random) -> dict:
    pick = rng.random()
    if pick < 0.45:
        animal, kind, habitat, food, trait = rng.choice(ANIMAL_FACTS)
        text = f"The {animal} is a {kind} that lives in {habitat}. It eats {food} and {trait}."
    elif pick < 0.85:
        city, country, river = rng.choice(CITY_FACTS)
        text = f"{city} is a large city in {country}. The river {river[4:]} flows through it."
    else:
        country, capital = rng.choice(CAPITALS_ZH)
        text = f"{capital}是{country}的首都，也是一座历史悠久的城市。"
    text += "".join(" " + s for s in rng.sample(EXTRA_SENTENCES, rng.randint(0, 4)))
    return {"text": text}


# The demo's task (`alignkit demo`): a fixed output format the bundled model does not produce on its own and
# learns in a few dozen LoRA steps. Each row is a sentence about a made-up person; the reply is their contact
# card, one JSON object with the fields name, age, city, job in that order. The instruction never names the
# fields, so only training can teach them; the values are copied from the sentence, which a 135M model does well.
# Common names, cities and jobs, each one token after a space in the bundled model's tokenizer: with rare names
# (Esme, Ingrid Thorne) the model learnt the card but copied 1 name in 2 wrong ("Esmé", "Hilke Thorne").
CARD_FIRST = ["Anna", "Tom", "Maria", "John", "Sarah", "David", "Laura", "Peter", "Emma", "James", "Lucy", "Mark",
              "Kate", "Paul", "Alice", "Daniel", "Helen", "Adam", "Julia", "Sam", "Rachel", "Simon", "Grace", "Oliver",
              "Emily", "Jack", "Clara", "Leo", "Nina", "Max", "Sofia", "Ben", "Eva", "Hugo", "Ella", "Victor"]
CARD_LAST = ["Smith", "Brown", "Wilson", "Taylor", "Clark", "Hall", "Young", "King", "Wright", "Green", "Baker",
             "Adams", "Hill", "Moore", "Cooper", "Ward", "Turner", "Parker", "Evans", "Morgan", "Bell", "Murphy",
             "Cook", "Reed"]
CARD_CITIES = ["Lisbon", "Oslo", "Nairobi", "Lyon", "Leeds", "Paris", "London", "Berlin", "Madrid", "Rome", "Vienna",
               "Dublin", "Prague", "Boston", "Denver", "Chicago", "Seattle", "Sydney", "Toronto", "Cairo", "Lima",
               "Bristol", "Munich", "Milan"]
CARD_JOBS = ["nurse", "baker", "pilot", "teacher", "architect", "librarian", "chemist", "gardener", "engineer",
             "translator", "carpenter", "dentist", "journalist", "tailor", "doctor", "lawyer", "farmer", "painter"]
CARD_INSTRUCTIONS = ["Make a contact card for this person.", "Turn this note into a contact card.",
                     "Write the contact card for the person below."]
CARD_NOTES = ["{name} is {age} and works as {a_job} in {city}.",
              "Meet {name}, {a_age_year_old} {job} from {city}.",
              "{name} ({age}) lives in {city} and is {a_job}.",
              "From {city}: {name}, {job}, age {age}.",
              "Our new neighbour is {name}. {pronoun} is {age}, moved here from {city} and works as {a_job}."]


def _a(word: str) -> str:
    """`word` with its indefinite article: "an engineer", "an 18-year-old", "a 21-year-old"."""
    vowel_sound = word[0] in "aeiou" or word.startswith(("8", "11-", "18-"))
    return ("an " if vowel_sound else "a ") + word


def make_card(rng: random.Random, n: int) -> list[dict]:
    """`n` contact-card rows, each about a different person (no full name repeats, so held-out people are new)."""
    people = [f"{first} {last}" for first in CARD_FIRST for last in CARD_LAST]
    rng.shuffle(people)
    rows = []
    for name in people[:n]:
        age, city, job = rng.randint(19, 78), rng.choice(CARD_CITIES), rng.choice(CARD_JOBS)
        note = rng.choice(CARD_NOTES).format(name=name, age=age, city=city, job=job, a_job=_a(job),
                                             a_age_year_old=_a(f"{age}-year-old"), pronoun=rng.choice(["She", "He"]))
        card = {"name": name, "age": age, "city": city, "job": job}
        rows.append({"instruction": rng.choice(CARD_INSTRUCTIONS), "input": note,
                     "output": json.dumps(card, ensure_ascii=False)})
    return rows


REGISTRY = {
    "demo_sft": {"file_name": "demo_sft.json",
                 "columns": {"prompt": "instruction", "query": "input", "response": "output", "system": "system"}},
    "demo_sft_eval": {"file_name": "demo_sft_eval.json",
                      "columns": {"prompt": "instruction", "query": "input", "response": "output", "system": "system"}},
    "demo_sft_sharegpt": {"file_name": "demo_sft_sharegpt.json", "formatting": "sharegpt",
                          "columns": {"messages": "conversations", "system": "system"}},
    "demo_pref": {"file_name": "demo_pref.json", "ranking": True,
                  "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}},
    "demo_pref_eval": {"file_name": "demo_pref_eval.json", "ranking": True,
                       "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                   "rejected": "rejected"}},
    "demo_math": {"file_name": "demo_math.json", "columns": {"prompt": "prompt", "response": "answer"}},
    # Held-out math problems for `alignkit eval`, written by scripts/make_math_eval.py (run it after this).
    "demo_math_eval": {"file_name": "demo_math_eval.json", "columns": {"prompt": "prompt", "response": "answer"}},
    "demo_pt": {"file_name": "demo_pt.json", "columns": {"prompt": "text"}},
    # Tool-use conversations for the calculator demo (make_tools_sft).
    "demo_tools_sft": {"file_name": "demo_tools_sft.json", "formatting": "sharegpt",
                       "columns": {"messages": "conversations", "tools": "tools"}},
    **{name: {"file_name": f"{name}.json", "columns": {"prompt": "instruction", "query": "input", "response": "output"}}
       for name in ("demo_card", "demo_card_eval")},
    **{name: {"file_name": f"{name}.json", "formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"},
              "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}
       for name in ("demo_kto", "demo_kto_eval")},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data", help="folder to write into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row generator")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # (training file, generator, training rows, held-out rows written to <name>_eval.json). Held-out rows
    # come from the same stream of unique prompts, so no evaluation prompt is ever trained on, and the
    # training rows are the same whatever the held-out count.
    datasets = [("demo_sft", make_sft, 300, 60), ("demo_sft_sharegpt", make_sharegpt, 100, 0),
                ("demo_pref", make_pref, 300, 60), ("demo_math", make_math, 300, 0), ("demo_pt", make_pt, 200, 0),
                ("demo_kto", make_kto, 300, 60), ("demo_card", make_card, 240, 40)]
    # One generator per file so that changing one dataset does not reshuffle the others.
    written = {}
    for i, (name, make, n_train, n_eval) in enumerate(datasets):
        rows = make(random.Random(args.seed * 1000 + i), n_train + n_eval)
        written[f"{name}.json"] = rows[:n_train]
        if n_eval:
            written[f"{name}_eval.json"] = rows[n_train:]
    # Last, as it avoids the problems of demo_math and of the held-out set drawn from it.
    written["demo_tools_sft.json"] = make_tools_sft(random.Random(args.seed * 1000 + len(datasets)), 200,
                                                    written["demo_math.json"])
    for file_name, part in written.items():
        (out / file_name).write_text(json.dumps(part, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out / file_name}: {len(part)} rows")
    (out / "dataset_info.json").write_text(json.dumps(REGISTRY, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out / 'dataset_info.json'}")


if __name__ == "__main__":
    main()
