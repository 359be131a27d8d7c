"""Compose the shipped prompt sets from the hand-written lists below (seeded: rerunning rewrites the files identically).

Usage: python compose.py <prompts folder>
"""
import json
import random
import sys
from pathlib import Path

out = Path(sys.argv[1])
rng = random.Random(20261130)

# ---------------------------------------------------------------- preference set
subjects = [
    "an old lighthouse keeper mending a fishing net", "a red fox curled up in fresh snow", "a steaming bowl of ramen",
    "a glass greenhouse full of orchids", "a tabby cat asleep on a stack of books", "a vintage bicycle leaning on a brick wall",
    "a hot air balloon over a patchwork of fields", "a child flying a kite on a windy beach", "a cozy reading nook by a rainy window",
    "a snow leopard on a rocky ledge", "a bustling night market with paper lanterns", "a tiny cottage in a mossy forest",
    "an astronaut tending a garden on the moon", "a jazz trio playing in a smoky club", "a stack of pancakes with blueberries",
    "a sailboat on a calm turquoise lagoon", "a medieval castle on a cliff above the sea", "a hummingbird drinking from a red flower",
    "a robot barista pouring latte art", "a field of sunflowers at golden hour", "a wooden rowboat tied to a misty dock",
    "an elderly couple dancing in their kitchen", "a waterfall hidden in a tropical jungle", "a chess game in a sunlit park",
    "a koi pond with lily pads", "a steam locomotive crossing a stone viaduct", "a bowl of ripe peaches on a linen cloth",
    "a desert canyon under a starry sky", "a street musician playing violin in the rain", "a treehouse with rope bridges",
    "a polar bear cub on drifting ice", "a bakery window full of croissants", "a dragon sleeping on a pile of gold",
    "a lavender field with a stone farmhouse", "a surfer riding a huge blue wave", "a library with spiral staircases",
    "a pair of owls on a birch branch", "a neon-lit alley in a futuristic city", "a farmer's market stall of heirloom tomatoes",
    "a paper boat floating down a gutter stream", "a mountain village covered in snow", "a ballerina mid-leap on an empty stage",
    "a golden retriever catching a frisbee", "a ceramic teapot with cherry blossoms", "a foggy pine forest at dawn",
    "a vintage typewriter on a wooden desk", "a coral reef full of colorful fish", "a fisherman's hut on stilts",
    "a white horse galloping along the surf", "a rooftop garden above a busy city", "a lantern-lit temple in the mountains",
    "a chef plating a tiny dessert", "a sleeping baby elephant", "a windmill beside a tulip field",
    "a glass of iced lemonade with mint", "a mechanic's workshop full of tools", "an ancient oak tree in a meadow",
    "a hedgehog holding a strawberry", "a cable car above a green valley", "a knight resting under a tree",
]
styles = [
    "photograph, 35mm, natural light", "oil painting, thick impasto brushstrokes", "watercolor illustration, soft edges",
    "studio Ghibli-inspired anime still", "highly detailed digital art", "cinematic still, dramatic lighting",
    "macro photograph, shallow depth of field", "pencil sketch with light shading", "isometric 3D render, pastel colors",
    "vintage film photo, grainy", "ukiyo-e woodblock print", "low-poly 3D illustration", "children's book illustration",
    "long exposure photograph", "claymation style", "art nouveau poster", "flat vector illustration", "charcoal drawing",
]
extras = ["", "", "at sunset", "in autumn", "on a foggy morning", "under a full moon", "in spring", "after the rain",
          "seen from above", "close-up", "wide angle"]
pref = set()
while len(pref) < 260:
    s, st, ex = rng.choice(subjects), rng.choice(styles), rng.choice(extras)
    pref.add(f"{s}{' ' + ex if ex else ''}, {st}")
pref = sorted(pref)
rng.shuffle(pref)
(out / "preference").mkdir(parents=True, exist_ok=True)
(out / "preference" / "train.txt").write_text("\n".join(pref[:220]) + "\n")
(out / "preference" / "test.txt").write_text("\n".join(pref[220:]) + "\n")

# ---------------------------------------------------------------- OCR set
texts = ["OPEN", "SALE", "HELLO", "EXIT", "CAFE", "STOP", "WELCOME", "FRESH BREAD", "NO PARKING", "GOOD MORNING",
         "HOTEL", "PIZZA", "BOOKS", "JAZZ NIGHT", "FLOWERS", "SUMMER", "DIFFUSION", "GRPO", "THANK YOU", "SLOW DOWN",
         "LIBRARY", "MARKET", "TAXI", "DANGER", "BAKERY", "COFFEE", "HAPPY BIRTHDAY", "PLATFORM 9", "ROUTE 66",
         "LEMONADE", "GARAGE", "CINEMA", "POST OFFICE", "MUSEUM", "ICE CREAM", "FISH AND CHIPS", "OPEN 24 HOURS",
         "QUIET PLEASE", "PARK", "HARBOR", "TICKETS", "PHARMACY", "GAME OVER", "LEVEL UP", "HOME SWEET HOME",
         "BEST DAD", "KEEP OUT", "MOON BASE", "TEA HOUSE", "NOODLES", "VINYL", "RECORDS", "SURF SHOP", "BIKE LANE",
         "FARM STAND", "ART GALLERY", "CANDY", "DRAGON", "MAGIC", "ROBOT"]
carriers = [
    'a neon sign in a dark window that says "{t}"', 'a wooden sign hanging over a shop door reading "{t}"',
    'a chalkboard menu with the words "{t}" written in white chalk', 'a coffee mug printed with the text "{t}"',
    'a paper banner held by two kids with "{t}" painted on it', 'a street sign that reads "{t}"',
    'a birthday cake with "{t}" written in icing', 'a vintage poster with the headline "{t}"',
    'a T-shirt on a hanger printed with "{t}"', 'a license plate that says "{t}"',
    'graffiti on a brick wall spelling "{t}"', 'a book cover titled "{t}"', 'a cardboard box stamped "{t}"',
    'a storefront awning with "{t}" in large letters', 'sand on a beach with "{t}" written in it',
    'a glowing arcade screen showing "{t}"', 'a road painted with the word "{t}"',
]
ocr = set()
while len(ocr) < 180:
    t, c = rng.choice(texts), rng.choice(carriers)
    ocr.add((c.format(t=t), t))
ocr = sorted(ocr)
rng.shuffle(ocr)
(out / "ocr").mkdir(parents=True, exist_ok=True)
for name, part in (("train", ocr[:150]), ("test", ocr[150:])):
    (out / "ocr" / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p, "text": t}) + "\n" for p, t in part))

# ---------------------------------------------------------------- compositional set (GenEval metadata format)
objects = ["cat", "dog", "horse", "bird", "cow", "sheep", "elephant", "bear", "zebra", "giraffe", "car", "bus",
           "bicycle", "motorcycle", "truck", "boat", "airplane", "train", "bench", "chair", "couch", "bed",
           "dining table", "tv", "laptop", "cell phone", "book", "clock", "vase", "cup", "bottle", "bowl", "banana",
           "apple", "orange", "broccoli", "carrot", "pizza", "donut", "cake", "umbrella", "backpack", "handbag",
           "suitcase", "teddy bear", "kite", "skateboard", "surfboard", "tennis racket", "fire hydrant",
           "stop sign", "traffic light", "potted plant", "toilet", "sink", "refrigerator", "oven", "scissors"]
colors = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
numbers = {2: "two", 3: "three", 4: "four"}
positions = ["left of", "right of", "above", "below"]

def art(w):
    return "an" if w[0] in "aeiou" else "a"

def plural(w):
    irregular = {"sheep": "sheep", "bus": "buses", "couch": "couches", "bench": "benches", "knife": "knives",
                 "cell phone": "cell phones", "tv": "tvs", "dining table": "dining tables", "sink": "sinks",
                 "scissors": "scissors", "broccoli": "broccoli", "skis": "skis"}
    return irregular.get(w, w + "es" if w.endswith(("s", "sh", "ch")) else w + "s")

rows = []
for o in objects:
    rows.append({"prompt": f"a photo of {art(o)} {o}", "tag": "single_object", "include": [{"class": o, "count": 1}]})
pairs = set()
while len(pairs) < 50:
    a, b = rng.sample(objects, 2)
    pairs.add((a, b))
for a, b in sorted(pairs):
    rows.append({"prompt": f"a photo of {art(a)} {a} and {art(b)} {b}", "tag": "two_object",
                 "include": [{"class": a, "count": 1}, {"class": b, "count": 1}]})
counts = set()
while len(counts) < 45:
    counts.add((rng.choice(objects[:48]), rng.choice(list(numbers))))
for o, n in sorted(counts):
    rows.append({"prompt": f"a photo of {numbers[n]} {plural(o)}", "tag": "counting",
                 "include": [{"class": o, "count": n}], "exclude": [{"class": o, "count": n + 1}]})
cols = set()
while len(cols) < 45:
    cols.add((rng.choice(objects), rng.choice(colors)))
for o, c in sorted(cols):
    rows.append({"prompt": f"a photo of {art(c)} {c} {o}", "tag": "colors", "include": [{"class": o, "count": 1, "color": c}]})
attr = set()
while len(attr) < 45:
    a, b = rng.sample(objects, 2)
    ca, cb = rng.sample(colors, 2)
    attr.add((a, ca, b, cb))
for a, ca, b, cb in sorted(attr):
    rows.append({"prompt": f"a photo of {art(ca)} {ca} {a} and {art(cb)} {cb} {b}", "tag": "color_attr",
                 "include": [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}]})
pos = set()
while len(pos) < 45:
    a, b = rng.sample(objects, 2)
    pos.add((a, rng.choice(positions), b))
for a, p, b in sorted(pos):
    rows.append({"prompt": f"a photo of {art(a)} {a} {p} {art(b)} {b}", "tag": "position",
                 "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [p, 0]}]})
by_tag = {}
for r in rows:
    by_tag.setdefault(r["tag"], []).append(r)
train, test = [], []
for rs in by_tag.values():
    rng.shuffle(rs)
    k = max(4, len(rs) // 6)
    test += rs[:k]
    train += rs[k:]
rng.shuffle(train)
(out / "geneval").mkdir(parents=True, exist_ok=True)
for name, part in (("train", train), ("test", test)):
    (out / "geneval" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
print(len(pref), len(ocr), len(train), len(test), {t: len(v) for t, v in by_tag.items()})
