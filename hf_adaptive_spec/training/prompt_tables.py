"""The fixed tables the template prompt sources fill (`training.prompts`): MT-Bench-style request templates
and their slot values, the docstring and passage request templates, and the prose templates with their
slots."""

from __future__ import annotations

__all__ = ["TEMPLATES", "TOPICS", "ROLES", "NAMES", "PLACES", "CODE", "SCIENCE", "DOC_TEMPLATES",
           "PASSAGE_TEMPLATES", "PROSE_TEMPLATES", "PROSE_SLOTS", "PROSE_FILLS"]


#: assistant requests by MT-Bench category; `{topic}`, `{name}`, `{a}` ... are filled in
TEMPLATES = {
    "writing": (
        "Write a short blog post about {topic}.",
        "Write a poem about {topic}.",
        "Write a persuasive email to a friend about {topic}.",
        "Write a short story in which {topic} plays a central role.",
        "Draft a two-paragraph speech on {topic} for a school assembly.",
    ),
    "roleplay": (
        "Pretend you are a {role}. A customer asks you about {topic}. What do you say?",
        "Act as a {role} and give me advice about {topic}.",
        "You are {name}, a famous expert on {topic}. Introduce yourself and your work.",
    ),
    "reasoning": (
        "{name} has {a} apples and gives {b} of them to a friend, then buys {c} more. How many apples does "
        "{name} have? Explain your reasoning.",
        "If it takes {a} workers {b} hours to build a wall, how long would it take {c} workers? Think step by step.",
        "What are the pros and cons of {topic}? Reason carefully before you answer.",
        "A train leaves at {hour}:00 and travels for {b} hours and {c} minutes. When does it arrive?",
    ),
    "math": (
        "What is {a} times {b} plus {c}? Show your work.",
        "Solve for x: {a}x + {b} = {c}.",
        "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        "What is the sum of all integers from 1 to {a}?",
        "Find the average of {a}, {b} and {c}.",
    ),
    "coding": (
        "Write a Python function that returns the {a} largest numbers of a list.",
        "Explain what a {code} is in programming, with a short example.",
        "Write a Python class that models {topic}, with at least two methods.",
        "How do I read a CSV file in Python and compute the mean of a column?",
        "Write a function in Python that checks whether a string is a palindrome, and explain it.",
    ),
    "extraction": (
        "Extract the names, places and numbers from this text: \"{name} visited {place} in {year} with {a} "
        "friends and spent {b} dollars on {topic}.\"",
        "Summarize the following in one sentence: \"{name} has studied {topic} for {a} years in {place}. "
        "The work was published in {year} and cited {b} times.\"",
        "Return a JSON object with the fields person, city and year from: \"In {year}, {name} moved to {place}.\"",
    ),
    "stem": (
        "Explain how {science} works in simple terms.",
        "What is the role of {science} in everyday life?",
        "Describe the main scientific ideas behind {topic}.",
    ),
    "humanities": (
        "What was the historical importance of {topic}?",
        "Discuss the ethical questions raised by {topic}.",
        "How has {topic} changed society over the last century?",
    ),
}


TOPICS = (
    "travel", "cooking", "space exploration", "the oceans", "ancient Rome", "music", "football", "climate change",
    "personal finance", "medicine", "gardening", "robots", "chess", "volcanoes", "trains", "photography", "birds",
    "the internet", "architecture", "movies", "coffee", "mountains", "education", "startups", "learning languages",
    "bicycles", "painting", "elections", "the moon", "batteries", "friendship", "libraries", "rivers",
    "video games", "hospitals", "city life", "deserts", "time management", "dinosaurs", "airplanes",
    "social media", "farming", "the Renaissance", "job interviews", "tea", "sleep", "solar power", "dogs", "cats",
    "poetry", "the stock market", "recycling", "forests", "vaccines", "earthquakes", "electric cars", "marathons",
    "jazz", "Shakespeare", "taxes", "museums", "bridges", "coral reefs", "the printing press", "ethics",
    "remote work", "artificial intelligence", "public transport", "the Olympic games", "bees",
)
ROLES = ("doctor", "chef", "detective", "pirate captain", "teacher", "travel agent", "personal trainer",
          "lawyer", "museum guide", "software engineer", "astronaut", "librarian")
NAMES = ("Alice", "Bob", "Maria", "Chen", "Fatima", "Lucas", "Priya", "Tom", "Yuki", "Omar")
PLACES = ("Paris", "Lagos", "Tokyo", "Lima", "Oslo", "Cairo", "Toronto", "Mumbai", "Sydney", "Berlin")
CODE = ("hash map", "linked list", "recursion", "closure", "binary search", "stack", "queue", "decorator",
         "generator", "REST API", "unit test", "regular expression")
SCIENCE = ("photosynthesis", "a refrigerator", "GPS", "the immune system", "nuclear fusion", "a transistor",
            "plate tectonics", "vaccination", "the greenhouse effect", "DNA replication", "a rainbow", "a laser")


#: requests about a piece of documentation; `{text}` is the docstring, `{name}` what it documents
DOC_TEMPLATES = (
    ("extraction", "Summarize the following text in two sentences.\n\n{text}"),
    ("extraction", "List the key points of this documentation as bullet points.\n\n{text}"),
    ("extraction", "Extract every function, class or parameter name mentioned in the text below and return "
                   "them as a JSON list.\n\n{text}"),
    ("writing", "Rewrite the following documentation of `{name}` so that a beginner can understand it.\n\n{text}"),
    ("coding", "Here is the documentation of the Python `{name}`:\n\n{text}\n\nWrite a short example that "
               "uses it, and explain the example."),
    ("stem", "Explain, in your own words, what problem `{name}` solves and when one would use it.\n\n{text}"),
    ("writing", "Write three questions a student could ask about the following text, with their answers."
                "\n\n{text}"),
)


#: requests about a passage; `{text}` is the passage, `{title}` the play or poem
PASSAGE_TEMPLATES = (
    ("writing", "Retell this passage from {title} in plain modern English prose.\n\n{text}"),
    ("extraction", "Summarize the following passage from {title} in two sentences.\n\n{text}"),
    ("extraction", "Which characters speak in the passage below? Answer with a JSON list of names.\n\n{text}"),
    ("humanities", "What happens in this passage from {title}, and why does it matter? Explain briefly.\n\n{text}"),
    ("humanities", "Which themes does this passage from {title} touch on? Give two examples from the text."
                   "\n\n{text}"),
    ("roleplay", "You are one of the speakers in this scene from {title}. In the first person, tell a friend what "
                 "just happened and how you feel about it.\n\n{text}"),
    ("writing", "Write a short poem in modern English inspired by this passage.\n\n{text}"),
)


#: open-ended requests in MT-Bench's prose-heavy categories (`prose_prompts`): `{x}` slots are filled from the
#: lists below. The benchmark's held-out questions (the first three of each MT-Bench category) are not
#: paraphrased: none of their subjects (Hawaii, Elon Musk, Sheldon, superposition, photosynthesis, economic
#: indicators, antitrust laws, satellite orbits, a financial-report email, a smartphone comparison, stages of
#: life) is among the slots.
PROSE_TEMPLATES = {
    "writing": (
        "Compose an engaging blog post about {place_trip}, highlighting the food, the people and the places "
        "worth visiting.",
        "Write a {form} about {subject}.",
        "Write a {form} about {subject} {constraint}.",
        "Draft a polite email to {recipient} asking for {request}.",
        "Draft a formal letter to {recipient} explaining {complaint}.",
        "Write a short story that begins with the sentence: \"{opening}\"",
        "Write a product description for {product} that would make people want to buy it.",
        "Write a persuasive essay arguing that {claim}.",
        "Create an outline for an article about {subject}, with headings and key points.",
        "Write a speech for {occasion} {constraint}.",
        "Write a dialogue between {character} and {character2} about {subject}.",
        "Describe {scene} in vivid detail, using all five senses.",
        "Write a review of an imaginary {venue} in {city}.",
        "Rewrite the following sentence in a more {tone} tone: \"{sentence}\"",
        "Write a motivational message for {audience} who {struggle}.",
        "Write the opening paragraph of a novel set in {setting}.",
        "Write a news article reporting on {event}.",
        "Create a catchy slogan and a short advertisement for {product}.",
    ),
    "roleplay": (
        "Pretend you are {character}. {situation}",
        "Imagine you are {character}. Describe a typical day in your life.",
        "Act as {character} and answer this question: {question}",
        "You are {character}. A young person asks you for advice on {topic}. What do you tell them?",
        "Take on the role of {job}. A client comes to you with this problem: {problem}. How do you help?",
        "Imagine yourself as {job} giving a short talk to {audience} about {topic}.",
        "Role-play as {character} writing a diary entry after {event}.",
        "Pretend to be a tour guide in {city}. Welcome your group and tell them what they will see today.",
        "You are {job}. Explain to {audience} what your work involves and why it matters.",
        "Act as a friendly {job} and recommend three things to someone interested in {topic}.",
    ),
    "reasoning": (
        "{puzzle}",
        "What are the advantages and disadvantages of {choice}? Think it through step by step.",
        "If {hypothesis}, what would be the consequences? Explain your reasoning.",
        "{name} says that {claim}. Is this argument convincing? Explain why or why not.",
        "Why might {observation}? Give several possible explanations.",
        "Compare {option_a} and {option_b}. Which would you choose for {purpose}, and why?",
        "What is wrong with this reasoning: \"{fallacy}\"?",
    ),
    "math": (
        "{name} saves {a} dollars every week. How many weeks does it take to save {total} dollars? Explain.",
        "A shop sells pens at {a} cents each and notebooks at {b} cents each. How much do {c} pens and {d} "
        "notebooks cost?",
        "A car travels {a} kilometers in {b} hours. What is its average speed, and how far would it go in {c} "
        "hours at that speed?",
        "What is {a} percent of {total}? Show each step.",
        "The price of a jacket is {total} dollars. It is discounted by {a} percent. What is the new price?",
        "Find the area of a circle with a radius of {a} centimeters.",
        "A class has {total} students and {a} of them are absent. What fraction of the class is present?",
        "Solve the system of equations: x + y = {total} and x - y = {a}.",
        "What is the probability of rolling a sum of {dice} with two fair dice? Explain.",
    ),
    "stem": (
        "Explain {concept} to a high-school student.",
        "What is the difference between {pair}? Give an example of each.",
        "How does {device} work? Describe the main steps.",
        "What would happen to {system} if {change}? Explain the science.",
        "Describe the history and the importance of {discovery}.",
        "What are the main causes of {phenomenon}, and how do scientists study it?",
        "Explain the concept of {concept} and give a real-world application.",
        "Why is {fact}? Give a clear scientific explanation.",
    ),
    "humanities": (
        "Discuss the causes and the consequences of {history}.",
        "How did {history} shape the world we live in today?",
        "What can we learn from {thinker} about {value}?",
        "Compare the ideas of {thinker} and {thinker2} on {value}.",
        "Discuss the role of {institution} in a democratic society.",
        "What influence has {culture} had on {domain}?",
        "What does {value} mean, and why do different cultures understand it differently?",
        "Analyze the main themes of {work}.",
        "Is {debate}? Present arguments on both sides.",
        "Explain how {economy} affects ordinary people, with examples.",
    ),
    "extraction": (
        "Identify the main idea and two supporting details in this paragraph: \"{paragraph}\"",
        "Classify the following items into categories and explain your choice: {items}.",
        "From the text below, extract every date, person and place, and present them as a table.\n\n"
        "\"{paragraph}\"",
        "Rate the sentiment of each sentence from 1 (negative) to 5 (positive): {reviews}",
    ),
}


PROSE_SLOTS = {
    "place_trip": ("a week in Kyoto", "a road trip through Patagonia", "a weekend in Lisbon", "a summer in "
                   "Iceland", "a train journey across Canada", "a visit to Marrakech", "a hiking trip in Nepal",
                   "a food tour of Mexico City", "a cycling holiday in the Netherlands", "a safari in Kenya",
                   "a winter trip to Finland", "a week on the Greek islands", "a visit to Istanbul",
                   "a backpacking trip through Vietnam", "a weekend in Edinburgh", "a trip to New Zealand"),
    "form": ("poem", "short story", "blog post", "limerick", "haiku sequence", "fable", "song", "sonnet",
             "news report", "diary entry", "letter to the editor", "short essay", "children's story",
             "motivational speech", "travel guide entry", "recipe introduction"),
    "subject": ("the first day of spring", "a lost umbrella", "a city at night", "growing old", "a rainy "
                "Monday", "learning to swim", "the last bookstore in town", "a robot that learns to paint",
                "friendship between a cat and a dog", "the sea", "a forgotten key", "winning a small prize",
                "a family dinner", "an old lighthouse", "moving to a new country", "the smell of bread",
                "a marathon runner", "a village without electricity", "a broken violin", "the night sky",
                "a kind stranger", "the importance of sleep", "a garden in autumn", "a difficult exam",
                "the history of chocolate", "working from home", "an abandoned train station",
                "saving the bees", "a grandmother's recipe", "the future of cities"),
    "constraint": ("in under 150 words", "for a teenage audience", "with a surprising ending",
                   "in a humorous tone", "in a formal tone", "in exactly three paragraphs", "that rhymes",
                   "for young children", "with a catchy title", "using simple words"),
    "recipient": ("your landlord", "a professor", "the manager of a hotel", "your neighbor", "a former "
                  "colleague", "the city council", "a customer", "your team"),
    "request": ("a deadline extension", "a letter of recommendation", "a meeting next week", "help with a "
                "project", "feedback on a presentation", "a refund", "permission to work remotely"),
    "complaint": ("a delayed delivery", "a noisy construction site", "an incorrect bill", "a cancelled "
                  "flight", "a broken heater", "poor customer service"),
    "opening": ("The letter arrived ten years too late.", "Nobody in the village had ever seen snow.",
                "The robot woke up before anyone else.", "She found the map inside an old book.",
                "The last train left without him.", "It was the quietest day the city had ever known.",
                "The dog refused to go home.", "Everything changed when the lights went out."),
    "product": ("a solar-powered backpack", "a smart water bottle", "a handmade wooden desk", "noise-"
                "cancelling headphones", "an electric scooter", "a plant-based burger", "a language-learning "
                "app", "a reusable notebook", "a coffee subscription", "a fitness tracker"),
    "claim": ("every student should learn a second language", "cities should ban cars from their centers",
              "homework should be optional", "libraries matter more than ever", "space exploration is worth "
              "the cost", "everyone should learn to cook", "museums should be free", "sport should be "
              "part of every school day", "people should read more fiction"),
    "occasion": ("a graduation ceremony", "a wedding", "the opening of a library", "a retirement party",
                 "a charity fundraiser", "the first day of a new job", "a science fair"),
    "character": ("a medieval knight", "a pirate captain", "Sherlock Holmes", "a friendly dragon",
                  "a time traveler from the year 3000", "a famous chef", "a wise old teacher", "an astronaut "
                  "on Mars", "a detective in 1920s Chicago", "a lighthouse keeper", "Cleopatra",
                  "Leonardo da Vinci", "a talking cat", "a Roman senator", "a news anchor", "a superhero"),
    "character2": ("a curious child", "a skeptical scientist", "a grumpy neighbor", "a young journalist",
                   "an alien visitor", "a robot", "a farmer"),
    "scene": ("a busy market in the morning", "a thunderstorm over the mountains", "a quiet library",
              "a beach at sunset", "a kitchen before a holiday dinner", "a crowded train station",
              "a forest after the rain", "a small café in winter"),
    "venue": ("restaurant", "hotel", "museum", "concert hall", "bookshop", "theme park"),
    "city": ("Rome", "Tokyo", "Buenos Aires", "Cairo", "Prague", "Seoul", "Vancouver", "Cape Town",
             "Dublin", "Bangkok"),
    "tone": ("formal", "friendly", "persuasive", "humorous", "poetic", "professional"),
    "sentence": ("We need to talk about the budget.", "The meeting is cancelled again.", "Your order is late.",
                 "I did not like the movie.", "The project is going well.", "Please clean the kitchen."),
    "audience": ("students", "new employees", "retired people", "young athletes", "parents", "beginners",
                 "a group of tourists", "children"),
    "struggle": ("are preparing for exams", "are starting a new job", "have failed at their first attempt",
                 "feel lonely", "are learning to code"),
    "setting": ("a floating city", "a small fishing village", "Victorian London", "a space station",
                "a desert oasis", "a snowy mountain town"),
    "event": ("the opening of a new bridge", "a local football victory", "a record heat wave", "the discovery "
              "of a new species", "a town festival", "a power outage", "a long journey home"),
    "situation": ("A customer asks you what makes your work special.", "Someone asks you for directions to "
                  "the nearest hospital.", "A child asks you why the sky is blue.", "A reporter asks you "
                  "about your greatest achievement.", "You must convince a crowd to help you."),
    "question": ("What is the secret of a happy life?", "What do you fear most?", "How should we treat "
                 "strangers?", "What is the best way to learn something new?", "What does success mean to you?"),
    "topic": ("choosing a career", "saving money", "making friends", "staying healthy", "learning to "
              "cook", "traveling alone", "public speaking", "reading more books", "dealing with stress"),
    "job": ("a doctor", "a lawyer", "a personal trainer", "a financial advisor", "a chef", "a librarian",
            "a software engineer", "a travel agent", "a psychologist", "a gardener", "an architect"),
    "problem": ("they cannot sleep well", "their small business is losing money", "they want to change "
                "careers", "they are moving to another country", "they feel stressed at work"),
    "puzzle": ("There are three boxes: one has only apples, one only oranges, one both. All labels are wrong. "
               "You may take one fruit from one box. How do you label the boxes correctly?",
               "A farmer must cross a river with a wolf, a goat and a cabbage. The boat holds the farmer and "
               "one item. How can he get everything across safely?",
               "If all roses are flowers and some flowers fade quickly, can we say that some roses fade "
               "quickly? Explain.",
               "Anna is taller than Ben, and Ben is taller than Carl. Is Carl taller than Anna? Explain.",
               "A bat and a ball cost 1.10 dollars in total. The bat costs 1 dollar more than the ball. How "
               "much does the ball cost?",
               "You have two ropes that each take one hour to burn, unevenly. How can you measure 45 minutes?",
               "Five friends sit in a row. Mia is next to Leo, Leo is not at either end, and Sam sits at the "
               "right end. Where could Mia sit?"),
    "choice": ("working from home", "living in a big city", "studying abroad", "owning a car", "using social "
               "media", "renting instead of buying a house", "starting a business young", "online learning"),
    "hypothesis": ("everyone worked only four days a week", "the internet disappeared for a month",
                   "humans could live to 150", "all cars were electric", "schools had no exams",
                   "it never rained again in one country"),
    "name": ("Alice", "Bob", "Maria", "Chen", "Fatima", "Lucas", "Priya", "Tom", "Yuki", "Omar"),
    "observation": ("a plant grows toward the window", "a town's population keeps shrinking", "people buy "
                    "more umbrellas in spring", "a student gets good grades in math but not in history",
                    "a shop is always empty on Tuesdays", "bread goes stale faster in the fridge"),
    "option_a": ("a laptop", "trains", "a dog", "a paper book", "a gym membership", "a small car"),
    "option_b": ("a tablet", "planes", "a cat", "an e-reader", "running outdoors", "a bicycle"),
    "purpose": ("a student", "a family of four", "a busy professional", "someone on a tight budget"),
    "fallacy": ("Everyone I know likes this movie, so it must be the best movie ever.", "If we allow "
                "students to use phones, soon nobody will study at all.", "He is not an expert, so his "
                "argument must be wrong.", "It rained after I washed my car, so washing my car causes rain."),
    "concept": ("gravity", "evolution by natural selection", "the water cycle", "electric current", "inertia",
                "the speed of light", "energy conservation", "an ecosystem", "probability", "the atom",
                "heat transfer", "a chemical reaction", "sound waves", "the carbon cycle", "genes and "
                "heredity", "friction", "magnetism", "black holes", "antibiotics", "machine learning"),
    "pair": ("weather and climate", "a virus and a bacterium", "mass and weight", "speed and velocity",
             "an element and a compound", "mitosis and meiosis", "AC and DC current", "renewable and "
             "non-renewable energy", "a comet and an asteroid", "RAM and storage"),
    "device": ("a microwave oven", "a solar panel", "a jet engine", "a smartphone camera", "a wind turbine",
               "a heat pump", "an electric motor", "a vaccine", "a 3D printer", "a thermometer"),
    "system": ("a lake", "the human heart", "a forest", "the Earth's climate", "a bee colony", "a river delta"),
    "change": ("its temperature rose by five degrees", "it lost half of its water", "a new predator "
               "arrived", "the sunlight was reduced", "pollution doubled"),
    "discovery": ("penicillin", "the printing press", "electricity", "the structure of DNA", "the telescope",
                  "the steam engine", "vaccination", "the periodic table", "radio waves", "the microscope"),
    "phenomenon": ("earthquakes", "hurricanes", "ocean tides", "the northern lights", "volcanic eruptions",
                   "droughts", "coral bleaching", "seasons"),
    "fact": ("the sky blue", "ice slippery", "the sea salty", "the Moon always showing the same face to the "
             "Earth", "metal cold to the touch", "a rainbow curved"),
    "history": ("the Industrial Revolution", "the fall of the Roman Empire", "the invention of writing",
                "the French Revolution", "the Silk Road", "the Renaissance", "the age of exploration",
                "the printing revolution", "the abolition of slavery", "the space race", "the Cold War",
                "the rise of the internet"),
    "thinker": ("Socrates", "Confucius", "Aristotle", "Immanuel Kant", "John Stuart Mill", "Simone de "
                "Beauvoir", "Marcus Aurelius", "Hannah Arendt", "Buddha", "Jean-Jacques Rousseau"),
    "thinker2": ("Plato", "Laozi", "Friedrich Nietzsche", "Thomas Hobbes", "Karl Marx", "Epicurus",
                 "John Locke", "Mary Wollstonecraft"),
    "value": ("happiness", "justice", "freedom", "friendship", "courage", "honesty", "duty", "equality",
              "the good life", "education"),
    "institution": ("a free press", "independent courts", "public schools", "elections", "trade unions",
                    "local government", "libraries"),
    "culture": ("jazz", "ancient Greek theater", "Japanese art", "hip hop", "the Beatles", "Hollywood",
                "social media", "the Olympic games", "classical music", "comic books"),
    "domain": ("modern music", "fashion", "the way we speak", "film", "politics", "education"),
    "work": ("George Orwell's 1984", "Romeo and Juliet", "The Odyssey", "Pride and Prejudice",
             "Don Quixote", "Frankenstein", "The Little Prince", "Hamlet", "Moby-Dick"),
    "debate": ("it right to keep animals in zoos", "technology making us less social", "it fair to tax the "
               "rich more", "history the most important school subject", "tourism good for small towns",
               "art still important in the age of machines"),
    "economy": ("inflation", "a rise in interest rates", "unemployment", "a minimum wage", "free trade",
                "a housing shortage"),
    "paragraph": ("In 1869, Mary Chen left Boston for San Francisco with her brother David. Two years later "
                  "they opened a small bakery near the harbor, which became famous in 1875.",
                  "The committee met in Geneva on 4 May 2015. Its chair, Dr. Amina Yusuf, proposed a new plan "
                  "for clean water in rural Kenya, which was approved by a large majority.",
                  "After the storm of March 2003, volunteers from Oslo and Bergen helped the town of Alta "
                  "rebuild its school. Mayor Lars Berg thanked them in a speech in June.",
                  "Walking is one of the simplest ways to stay healthy. It strengthens the heart, improves "
                  "mood and costs nothing, yet many people walk less than twenty minutes a day."),
    "items": ("apple, hammer, violin, carrot, screwdriver, flute, banana, drum",
              "Mars, oak, salmon, Jupiter, tulip, eagle, Venus, fern",
              "Paris, Nile, Everest, Tokyo, Amazon, Alps, Cairo, Danube"),
    "reviews": ("1. The food was cold and the waiter was rude. 2. A wonderful evening, I loved every dish. "
                "3. It was fine, nothing special.",
                "1. Best phone I have ever owned. 2. The battery died after a week. 3. Decent value for the "
                "price."),
}


PROSE_FILLS = {"math": 12, "extraction": 12}  # random fills per template (70 for the other categories)
