"""The forward each model of a run uses, chosen once at setup: the one place that turns the flags and a model's own
support checks into the object every later call goes through.

A causal LM's forward (policy_common.Forward: log-probs, the next-token distribution, per-token results of it) is the
plain one, or built from these, each a subclass in its own module that gives the same numbers to float rounding:
  prompt_sharing.SharedPromptForward  rows that repeat a prompt encode it once (--share_prompts, where it saves enough)
  packing.PackedForward               every row's real tokens packed, no padding (--padding_free, where the model's
                                      packed forward matches its padded one)
  chunked_head.ChunkedHead            the output layer a chunk of positions at a time (--logprob_chunk_tokens)
A reward or value model's (policy_common.ScalarForward) likewise: plain, sharing prompts, packed. A new way to run a
forward is one more subclass and one more line here; the scripts, the sampler and the losses do not change.

`Forwards` holds what a script asks for; `lm(model)` and `scalar(model)` answer it for one model, checking that model
once. The decisions use only flags and the model (never one process's data), so every process makes the same model
calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

import policy_common as pc
from plumbing import chunked_head, models, packing, vision
from plumbing import prompt_sharing as ps


@dataclass(frozen=True)
class Forwards:
    """What a run asks of its models' forwards: the pad token, the sampling temperature (log-probs are taken of logits /
    temperature), --padding_free, --logprob_chunk_tokens, and `repeats`: how the rows it scores repeat prompts (the
    rollout's k samples, a pair's two completions), None when they do not or --share_prompts is off."""
    pad_token_id: int
    temperature: float = 1.0
    padding_free: bool = False
    chunk_tokens: Optional[int] = 0
    repeats: Optional[ps.Repeats] = None

    @classmethod
    def from_args(cls, args, pad_token_id: int, *, temperature: float = 1.0,
                  repeats: Optional[ps.Repeats] = None) -> "Forwards":
        """From a script's flags: --padding_free (every script), --logprob_chunk_tokens (the scripts with PolicyFlags;
        else 0), --share_prompts (the scripts with PromptSharingFlags; else nothing is shared)."""
        share = isinstance(args, ps.PromptSharingFlags) and args.share_prompts
        chunk_tokens = args.logprob_chunk_tokens if isinstance(args, models.PolicyFlags) else 0
        return cls(pad_token_id, temperature, args.padding_free, chunk_tokens, repeats if share else None)

    def shares_prompts(self, packed: bool) -> bool:
        """Are repeated prompts encoded once: the rows repeat them, and it saves enough (ps.worth_sharing)?"""
        return self.repeats is not None and ps.worth_sharing(*self.repeats, packed=packed)

    def lm(self, model: nn.Module) -> pc.Forward:
        """The forward of causal LM `model`: packed where --padding_free asks and its packed forward matches its padded
        one, each repeated prompt encoded once where that saves enough, the output layer in chunks unless
        --logprob_chunk_tokens is 0 or the model transforms its output layer's result."""
        images = vision.is_vision_model(models.causal_lm(model).config)
        if images:  # image inputs ride with each row through the plain forward only
            self.note_images_step_aside(model)
        packed = self.padding_free and not images and packing.lm_supported(model, self.pad_token_id)
        shared = self.shares_prompts(packed) and not images
        forward = (ps.SharedPromptForward if shared else pc.Forward)(
            self.pad_token_id, self.temperature, vision.image_token_ids(models.causal_lm(model).config))
        if packed:
            forward = packing.PackedForward(forward)
        if self.chunk_tokens != 0 and chunked_head.supported(model):
            forward = chunked_head.ChunkedHead(forward, self.chunk_tokens)
        return forward

    def note_images_step_aside(self, model: nn.Module) -> None:
        """One line naming the speed paths a vision-language model's forward does without, where the flags asked for
        them: packing (image tokens, multimodal positions) and prompt sharing (images are encoded with their prompt)."""
        paths = [name for name, asked in (("--padding_free", self.padding_free),
                                          ("prompt sharing", self.shares_prompts(False))) if asked]
        if paths:
            print(f"note: {type(models.causal_lm(model)).__name__} takes images: its forwards run without "
                  f"{' and '.join(paths)}", flush=True)

    def scalar(self, model: nn.Module) -> pc.ScalarForward:
        """The forward of sequence classifier `model` (a reward or value model): packed where --padding_free asks and
        its backbone's packed forward matches its padded one, each repeated prompt encoded once where that saves
        enough."""
        base = models.unwrap(model)
        packed = self.padding_free and packing.backbone_supported(getattr(base, base.base_model_prefix),
                                                                  self.pad_token_id)
        forward = (ps.SharedPromptScalarForward if self.shares_prompts(packed) else pc.ScalarForward)(self.pad_token_id)
        return packing.PackedScalarForward(forward) if packed else forward

    def replace(self, **changes) -> "Forwards":
        """These forwards with some settings changed (e.g. another pad token and no repeats: a reward model reading
        re-tokenised text)."""
        return dataclasses.replace(self, **changes)
