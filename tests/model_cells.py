"""Real models built from configs (no download), as notebook cells: a `transformers` Llama causal LM
trained with AdamW, clipping and a scheduler; BERT fine-tuned on an input dict; Llama `generate`. Each
setup defines `model` (and `opt`), `reset()` (back to the start state: weights, optimizer, scheduler, RNG)
and `fingerprint()` / `same(a, b)` (the model and optimizer state, to compare a retried run with one clean
run). Each cell reads `bs`. Used by tests/test_real_models.py and bench/bench_retry_training.py, with the
cap each is sized for and the largest bs that fits under it with torch 2.13 (retry_helpers.largest checks
the pin and finds the true value where a torch differs)."""
from __future__ import annotations

COMMON = """
import copy, gc, torch
torch.manual_seed(0)
def fingerprint():
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():      # copies kept by the caller, not on the simulated device
        state = [t.detach().clone() for t in model.state_dict().values()]
        o = globals().get("opt")
        if o is not None:
            state += [v.detach().clone() for s in o.state_dict()["state"].values() for v in s.values()
                      if isinstance(v, torch.Tensor)]
        return state
def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
"""

LLAMA = COMMON + """
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=128)
model = LlamaForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict()),
         torch.get_rng_state())
def reset():
    for n in ("ids", "out"):
        globals().pop(n, None)
    gc.collect()
    model.load_state_dict(start[0]); opt.load_state_dict(copy.deepcopy(start[1])); sched.load_state_dict(start[2])
    torch.set_rng_state(start[3])
    for p in model.parameters():
        p.grad = None
"""
LLAMA_CELL = """model.train()
for step in range(2):
    ids = torch.randint(0, 512, (bs, 32))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); sched.step(); opt.zero_grad()
"""
LLAMA_CAP, LLAMA_LARGEST = "64MiB", 101

BERT = COMMON + """
from transformers import BertConfig, BertForSequenceClassification
cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=128, num_labels=3)
model = BertForSequenceClassification(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state())
def reset():
    for n in ("batch", "out"):
        globals().pop(n, None)
    gc.collect()
    model.load_state_dict(start[0]); opt.load_state_dict(copy.deepcopy(start[1])); torch.set_rng_state(start[2])
    for p in model.parameters():
        p.grad = None
"""
BERT_CELL = """model.train()
for step in range(2):
    batch = {"input_ids": torch.randint(0, 512, (bs, 48)), "attention_mask": torch.ones(bs, 48, dtype=torch.long),
             "labels": torch.randint(0, 3, (bs,))}
    out = model(**batch)
    out.loss.backward()
    opt.step(); opt.zero_grad()
"""
BERT_CAP, BERT_LARGEST = "48MiB", 78

GENERATE = COMMON + """
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0)
model = LlamaForCausalLM(cfg).eval()
def reset():
    for n in ("prompts", "out"):
        globals().pop(n, None)
    gc.collect()
"""
GENERATE_CELL = """prompts = torch.randint(1, 512, (bs, 16))
with torch.no_grad():
    out = model.generate(prompts, max_new_tokens=48, min_new_tokens=48, do_sample=False)
"""
GENERATE_CAP, GENERATE_LARGEST = "32MiB", 376

# a ResNet (torchvision's BasicBlock, written out: torchvision's CPU build does not install beside the CPU
# torch here) trained through a DataLoader of uint8 images
RESNET = COMMON + """
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Block(nn.Module):              # torchvision's BasicBlock
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))

class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layers = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))

model = ResNet()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = TensorDataset(torch.randint(0, 256, (512, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (512,)))
losses = []
start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state())
def reset():
    for n in ("loader", "xb", "yb", "loss"):
        globals().pop(n, None)
    gc.collect()
    model.load_state_dict(start[0]); opt.load_state_dict(copy.deepcopy(start[1])); torch.set_rng_state(start[2])
    for p in model.parameters():
        p.grad = None
"""
RESNET_CELL = """model.train()
loader = DataLoader(data, batch_size=bs, shuffle=True)
for step, (xb, yb) in enumerate(loader):
    loss = nn.functional.cross_entropy(model(xb.float().div_(255)), yb)
    loss.backward()
    opt.step(); opt.zero_grad()
    if step == 1:
        break
"""

# name -> (what it is, setup, cell, cap, largest bs that fits under the cap)
MODELS = {
    "llama": ("2 steps of AdamW with clipping and a scheduler on a transformers Llama causal LM (2 layers, "
              "width 64, 32 tokens)", LLAMA, LLAMA_CELL, LLAMA_CAP, LLAMA_LARGEST),
    "bert": ("2 steps of AdamW fine-tuning a transformers BERT classifier on an input dict (2 layers, width 64, "
             "48 tokens)", BERT, BERT_CELL, BERT_CAP, BERT_LARGEST),
    "generate": ("transformers Llama `generate`, 48 new tokens after 16 under no_grad (2 layers, width 64)",
                 GENERATE, GENERATE_CELL, GENERATE_CAP, GENERATE_LARGEST),
}

# a transformers Trainer over the Llama model above: it makes its own optimizer and DataLoader, and reads
# its batch size when it is made (so a cell that retries it makes it again)
TRAINER = """
import tempfile
from transformers import Trainer, TrainingArguments
class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 1024
    def __getitem__(self, i):
        ids = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
tokens, out_dir = Tokens(), tempfile.mkdtemp()
def arguments(bs, acc):
    return TrainingArguments(output_dir=out_dir, per_device_train_batch_size=bs, gradient_accumulation_steps=acc,
                             max_steps=2, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             disable_tqdm=True)
"""
TRAINER_CELL = """trainer = Trainer(model=model, args=arguments(bs, acc), train_dataset=tokens)
trainer.train()
"""
