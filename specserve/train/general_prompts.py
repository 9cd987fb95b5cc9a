"""specserve's own general-question prompts for head training: everyday questions, explanations, advice, short
writing tasks and arithmetic word problems, composed from topic lists and question forms written for this project.

Heads learn what the target says after the kind of text users send; the stdlib code prompts (`prompt_set.py`)
cover code, these cover conversation. Nothing here is copied from a benchmark; `prompt_files.check_held_out`
still guards the evaluation sets. Deterministic for a seed.
"""

from __future__ import annotations

import itertools
import random

SUBJECTS = [
    "photosynthesis", "the water cycle", "plate tectonics", "volcanoes", "earthquakes", "hurricanes", "tides",
    "the seasons", "rainbows", "lightning", "black holes", "the phases of the moon", "gravity", "magnetism",
    "electricity", "nuclear energy", "solar panels", "wind turbines", "batteries", "the greenhouse effect",
    "vaccines", "the immune system", "sleep", "dreams", "memory", "habits", "stress", "exercise", "nutrition",
    "vitamins", "dehydration", "caffeine", "meditation", "posture", "the human heart", "the lungs", "digestion",
    "DNA", "evolution", "bees", "ants", "whales", "octopuses", "migratory birds", "coral reefs", "rainforests",
    "deserts", "glaciers", "soil", "composting", "recycling", "inflation", "interest rates", "budgeting",
    "credit scores", "index funds", "taxes", "supply and demand", "small businesses", "remote work",
    "job interviews", "public speaking", "negotiation", "time management", "procrastination", "learning a language",
    "reading faster", "note taking", "studying for exams", "teamwork", "leadership", "giving feedback",
    "the printing press", "the Roman Empire", "ancient Egypt", "the Industrial Revolution", "the Silk Road",
    "the invention of the telephone", "the history of the bicycle", "the first airplanes", "the space race",
    "democracy", "elections", "the jury system", "copyright", "open source software", "the internet",
    "email", "passwords", "encryption", "phishing", "cloud storage", "smartphones", "GPS", "Wi-Fi",
    "search engines", "databases", "spreadsheets", "computer viruses", "artificial intelligence", "robots",
    "3D printing", "electric cars", "trains", "airports", "bridges", "skyscrapers", "plumbing", "refrigerators",
    "microwave ovens", "baking bread", "fermentation", "coffee", "tea", "chocolate", "cheese", "spices",
    "knife skills", "meal planning", "gardening", "houseplants", "tomato plants", "birdwatching", "camping",
    "hiking", "running", "swimming", "cycling", "yoga", "chess", "jazz", "the piano", "the guitar",
    "photography", "painting with watercolors", "pottery", "knitting", "poetry", "novels", "theater",
    "museums", "libraries", "volunteering", "moving to a new city", "adopting a dog", "caring for a cat",
    "raising chickens", "saving energy at home", "fixing a leaky faucet", "painting a room", "car maintenance",
    "packing for travel", "jet lag", "learning to drive", "first aid", "fire safety", "making friends as an adult",
    "the solar system", "comets", "the northern lights", "ocean currents", "clouds", "fog", "snowflakes",
    "wildfires", "floods", "droughts", "air pollution", "noise pollution", "light pollution", "groundwater",
    "wetlands", "mountains", "caves", "rivers", "islands", "penguins", "wolves", "elephants", "sharks", "owls",
    "butterflies", "frogs", "spiders", "mushrooms", "moss", "trees in autumn", "seeds", "pollination",
    "bacteria", "viruses", "antibiotics", "allergies", "headaches", "back pain", "eyesight", "hearing",
    "the brain", "muscles", "bones", "teeth", "skin care", "sunscreen", "breakfast", "sugar", "salt", "fiber",
    "protein", "vegetarian cooking", "soup", "salads", "rice", "pasta", "eggs", "olive oil", "herbs",
    "baking cookies", "pickling vegetables", "food storage", "kitchen hygiene", "grocery shopping",
    "personal finance", "retirement savings", "emergency funds", "insurance", "renting an apartment",
    "buying a house", "freelancing", "starting a podcast", "writing a resume", "career changes", "mentoring",
    "online courses", "homeschooling", "math anxiety", "fractions", "percentages", "probability",
    "statistics", "geometry", "algebra", "prime numbers", "the metric system", "maps", "time zones",
    "calendars", "clocks", "money", "banks", "stock markets", "cryptocurrency", "shipping containers",
    "supermarkets", "restaurants", "farming", "irrigation", "fishing", "forestry", "mining", "steel", "glass",
    "plastic", "paper", "cotton", "wool", "dyes", "soap", "candles", "fireworks", "magnets in motors",
    "radio", "television", "cameras", "headphones", "keyboards", "video games", "board games", "card games",
    "puzzles", "crossword puzzles", "sudoku", "origami", "drawing", "calligraphy", "woodworking", "sewing",
    "baking a cake", "birthday traditions", "holidays around the world", "weddings", "tipping customs",
    "etiquette at dinner parties", "small talk", "active listening", "apologizing", "saying no politely",
    "handling criticism", "motivation", "goal setting", "daily routines", "decluttering", "minimalism",
    "living with roommates", "long-distance friendships", "grandparents", "siblings", "parenting toddlers",
    "teenagers and phones", "school lunches", "field trips", "science fairs", "spelling", "grammar",
    "punctuation", "storytelling", "fairy tales", "myths", "comic books", "podcasts", "documentaries",
    "classical music", "rock music", "singing", "drums", "dance", "marathons", "tennis", "soccer",
    "basketball", "baseball", "skiing", "surfing", "rock climbing", "sailing", "kayaking", "horse riding",
    "the Olympics", "lighthouses", "castles", "pyramids", "the Great Wall of China", "medieval knights",
    "Vikings", "ancient Greece", "the Renaissance", "the age of exploration", "the history of money",
    "the history of writing", "the history of medicine", "the invention of the light bulb", "steam engines",
    "canals", "public transport", "city parks", "traffic", "roundabouts", "speed limits", "electric scooters",
]

QUESTION_FORMS = [
    "Explain {s} in simple terms.",
    "What are the most common misconceptions about {s}?",
    "Give me a short overview of {s}.",
    "Why does {s} matter in everyday life?",
    "Write a short paragraph introducing {s} to a beginner.",
    "What are three interesting facts about {s}?",
    "How would you explain {s} to a twelve-year-old?",
    "What questions should a curious person ask about {s}?",
    "Summarize the key ideas behind {s}.",
    "What is the history of {s}, briefly?",
    "List some practical tips related to {s}.",
    "Write a short blog post about {s}.",
    "What are the advantages and disadvantages of {s}?",
    "Describe a common problem people have with {s} and how to solve it.",
    "Write a haiku about {s}.",
    "Write a four-line poem about {s}.",
    "Create a short quiz with three questions about {s}.",
    "What would a good first lesson on {s} cover?",
    "Write a friendly tweet that teaches something about {s}.",
    "Tell a short story in which {s} plays an important role.",
    "I keep hearing about {s}. What is it, in a few sentences?",
    "What is one thing most people get wrong about {s}?",
    "Give me five quick facts about {s} for a school presentation.",
    "How has {s} changed over the last hundred years?",
    "What would the world be like without {s}?",
    "Write a short dialogue between a teacher and a student about {s}.",
    "Describe {s} using an everyday analogy.",
    "What should a beginner read or watch to learn about {s}?",
    "Write a limerick about {s}.",
    "What are the safety considerations around {s}?",
]

PAIRS = [
    ("a cold", "the flu"), ("a lake", "a pond"), ("a comet", "an asteroid"),
    ("baking soda", "baking powder"), ("a loan", "a lease"), ("saving", "investing"), ("stocks", "bonds"),
    ("a crocodile", "an alligator"), ("a violin", "a viola"), ("a novel", "a novella"), ("RAM", "storage"),
    ("a laptop", "a desktop"), ("renting a car", "taking the train"), ("tea", "coffee"), ("jogging", "walking"),
    ("a democracy", "a republic"), ("an essay", "a report"), ("speed", "velocity"),
    ("mass", "weight"), ("a simile", "a metaphor"), ("empathy", "sympathy"), ("a museum", "a gallery"),
    ("email", "instant messaging"), ("a hobby", "a career"), ("a mortgage", "rent"), ("an e-book", "a paper book"),
    ("a frog", "a toad"), ("a rabbit", "a hare"),
    ("a credit card", "a debit card"), ("a city", "a town"), ("an ocean", "a sea"), ("a moth", "a butterfly"),
    ("baking", "roasting"), ("a podcast", "an audiobook"), ("a sprint", "a marathon"), ("a poem", "a song"),
    ("a fruit", "a vegetable"), ("a planet", "a star"), ("a hill", "a mountain"), ("a want", "a need"),
    ("a fact", "an opinion"), ("a goal", "a habit"), ("a manager", "a leader"), ("tablets", "laptops"),
]

PAIR_FORMS = [
    "What is the difference between {a} and {b}?",
    "Compare {a} and {b} in a few sentences.",
    "When would you choose {a} over {b}?",
    "Which is better for a beginner, {a} or {b}, and why?",
]

TASKS = [
    "plan a birthday party for a child", "prepare for a marathon", "write a cover letter", "start a vegetable garden",
    "organize a messy closet", "learn to cook on a budget", "prepare for a long flight", "host a dinner for friends",
    "set up a home office", "train a puppy to sit", "make a weekly budget", "get better at chess",
    "write a short story", "start journaling", "clean a cast iron pan", "choose a used car", "plan a road trip",
    "prepare for a job interview", "reduce screen time", "make homemade pizza", "learn to juggle",
    "teach a child to ride a bike", "keep a conversation going", "pack a lunch for work", "decorate a small room",
    "improve handwriting", "memorize a speech", "fall asleep faster", "save money on groceries",
    "start running in the morning", "write a thank-you note", "choose a good book", "care for a succulent",
    "learn to swim as an adult", "repot a houseplant", "change a flat tire", "make a good cup of tea",
    "ask for a raise", "plan a picnic", "write a wedding toast", "prepare for a storm", "pick a good watermelon",
    "keep a sourdough starter alive", "stop biting my nails", "organize my photos", "learn basic first aid",
    "make new friends in a new city", "prepare a presentation", "study for a math test", "build a birdhouse",
    "set up a fish tank", "plan a vegetable-only week of meals", "wake up earlier", "get rid of fruit flies",
    "sharpen a kitchen knife", "start a book club", "teach my parents to use a smartphone", "brew cold coffee",
    "paint a fence", "write a complaint letter", "keep my houseplants alive while travelling",
]

TASK_FORMS = [
    "How do I {t}?",
    "Give me a step-by-step plan to {t}.",
    "What mistakes should I avoid when I {t}?",
    "I want to {t}. Where should I start?",
    "Write a checklist for someone who wants to {t}.",
    "What tools or supplies do I need to {t}?",
    "How long does it usually take to {t}?",
]

NAMES = ["Maya", "Omar", "Lena", "Kofi", "Ines", "Tariq", "Priya", "Jonas", "Aiko", "Diego", "Nora", "Samir"]
ITEMS = [("apples", 0.5), ("notebooks", 2), ("pencils", 0.25), ("tickets", 12), ("muffins", 1.5), ("plants", 4)]


def word_problems(rng: random.Random, count: int) -> list[str]:
    """Arithmetic word problems with fresh numbers: the shapes of everyday maths, not any benchmark's items."""
    problems = []
    for _ in range(count):
        name, other = rng.sample(NAMES, 2)
        item, price = rng.choice(ITEMS)
        n, m = rng.randint(3, 40), rng.randint(2, 9)
        problems.append(rng.choice([
            f"{name} buys {n} {item} at ${price} each and pays with a ${rng.choice([20, 50, 100])} bill. "
            f"How much change does {name} get? Explain your steps.",
            f"{name} has {n} {item} and gives {other} {m} of them every day. After how many days does {name} "
            f"run out? Show your reasoning.",
            f"A recipe for {m} people needs {n} grams of flour. How much flour is needed for {m + rng.randint(1, 6)} "
            f"people? Work it out step by step.",
            f"A car travels {n * 10} km in {m} hours. What is its average speed, and how far does it go in "
            f"{m + 2} hours at that speed?",
            f"{name} reads {m} pages a day. A book has {n * 10} pages. How many days will it take, and how many "
            f"pages are read on the last day?",
            f"A garden is {n} meters long and {m} meters wide. What are its area and its perimeter?",
        ]))
    return problems


def general_prompts(seed: int = 0, word_problem_count: int = 800) -> list[str]:
    """Every subject x question form, pair x pair form and task x task form, plus word problems; shuffled."""
    prompts = [form.format(s=s) for s, form in itertools.product(SUBJECTS, QUESTION_FORMS)]
    prompts += [form.format(a=a, b=b) for (a, b), form in itertools.product(PAIRS, PAIR_FORMS)]
    prompts += [form.format(t=t) for t, form in itertools.product(TASKS, TASK_FORMS)]
    rng = random.Random(seed)
    prompts += word_problems(rng, word_problem_count)
    prompts = [p[0].upper() + p[1:] for p in dict.fromkeys(prompts)]
    rng.shuffle(prompts)
    return prompts
