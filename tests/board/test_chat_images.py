"""The board's chat with an image, without a browser: on a vision-language run (the tiny LLaVA built here) the image
given with a message reaches the model as `alignkit chat --image` gives it (the same `chat.reply_pieces`), so the
greedy replies are the same; it stays in the conversation for the next message; a text-only run is refused on the
page before any weights load."""

from __future__ import annotations

import io

import pytest
import torch

from alignkit import chat as chat_module
from alignkit.board.app import Board, _shown, build_app, chat_conversation
from alignkit.config import GeneratingArguments, ModelArguments
from alignkit.errors import ConfigError
from tests.board.test_chat_tools import _run
from tests.stages.test_multimodal import write_png


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from alignkit.model.tiny import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture
def board(tmp_path, vlm_dir, tiny_model_dir):
    root, workdir = tmp_path / "saves", tmp_path / "work"
    workdir.mkdir()
    _run(root, workdir, "vlm", str(vlm_dir), template=None)  # the tokenizer's own template, as chat's default
    _run(root, workdir, "plain", tiny_model_dir)
    return Board(root, workdir)


@pytest.fixture
def seen(monkeypatch):
    """(input_ids, pixel inputs) of every generation through chat's path."""
    from tests.helpers import record_chat_generations

    return record_chat_generations(monkeypatch)


def respond_of(board):
    (respond,) = {f.fn for f in build_app(board).fns.values() if getattr(f.fn, "__name__", "") == "respond"}
    return respond


def test_the_page_chat_with_an_image_answers_as_chat_image_does(board, vlm_dir, tmp_path, seen):
    cat = tmp_path / "cat.png"
    write_png(cat, seed=5)
    expected = chat_module.chat(ModelArguments(model_name_or_path=str(vlm_dir)), GeneratingArguments(max_new_tokens=6),
                                prompt="What is it?", images=[str(cat)], stream=io.StringIO())
    expected_ids, expected_pixels = seen[0]
    seen.clear()
    respond = respond_of(board)
    *_, (run_history, base_history, box, error, image, _) = respond("vlm", "What is it?", [], [], 6, "", str(cat))
    assert (box, error, image) == ("", "", None)
    turn = {"role": "user", "content": [{"path": str(cat)}, "What is it?"]}
    # (the random model's greedy reply is whitespace, which the page says in words; the raw reply is compared too)
    assert run_history == base_history == [turn, {"role": "assistant", "content": _shown(expected)}]
    assert "".join(board.reply(board.chat_pair("vlm")[0], [{"role": "user", "content": "<image>What is it?"}], 6,
                               [str(cat)])) == expected
    assert len(seen) == 3  # the run's model, its base, the raw reply
    processing = chat_module.chat_images(ModelArguments(model_name_or_path=str(vlm_dir)), [str(cat)])
    for input_ids, pixels in seen:
        assert torch.equal(input_ids, expected_ids) and (input_ids == processing.image_token_id).sum() == 4
        assert torch.equal(pixels["pixel_values"], expected_pixels["pixel_values"])
        assert pixels["pixel_values"].shape == (1, 3, 28, 28)
    assert len(board.chat_processors) == 2  # each model's processor, loaded once and kept

    # The next message without an image: the first one's image stays in the conversation, in Gradio's own shape.
    seen.clear()
    returned = [{"role": "user", "content": [{"type": "file", "file": {"path": str(cat)}},
                                             {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": expected}]}]
    list(respond("vlm", "And now?", returned, returned, 6, "", None))
    assert [pixels["pixel_values"].shape for _, pixels in seen] == [(1, 3, 28, 28)] * 2
    assert (seen[0][0] == processing.image_token_id).sum() == 4


def test_an_image_for_a_text_only_run_is_refused_on_the_page(board, tmp_path, seen):
    cat = tmp_path / "cat.png"
    write_png(cat, seed=5)
    respond = respond_of(board)
    *_, (run_history, base_history, _, error, _, _) = respond("plain", "What is it?", [], [], 6, "", str(cat))
    assert run_history == base_history == [] and not seen
    assert "the chat's image needs a vision-language model" in error and "is text-only" in error
    (tmp_path / "bad.png").write_bytes(b"not an image")
    *_, (_, _, _, error, _, _) = respond("vlm", "What is it?", [], [], 6, "", str(tmp_path / "bad.png"))
    assert "the chat's image: " in error and "bad.png" in error and not seen
    *_, (_, _, _, error, _, _) = respond("vlm", "<image> and <image>?", [], [], 6, "", str(cat))
    assert "1 image(s) given but the message holds 2 <image>" in error


def test_chat_conversation_places_each_turns_images():
    history = [{"role": "user", "content": [{"path": "a.png"}, "What is it?"]},
               {"role": "assistant", "content": "A cat."},
               {"role": "assistant", "content": "-> f()", "metadata": {"title": "tool call"}},
               {"role": "user", "content": [{"type": "file", "file": {"path": "b.png"}},
                                            {"type": "text", "text": "And <image> here?"}]}]
    messages, images = chat_conversation(history)
    assert messages == [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A cat."},
                        {"role": "user", "content": "And <image> here?"}]
    assert images == ["a.png", "b.png"]
    assert chat_conversation([{"role": "user", "content": "<image>?"}]) == ([{"role": "user", "content": "<image>?"}], [])
    with pytest.raises(ConfigError, match="holds 1 <image> text"):
        chat_conversation([{"role": "user", "content": "<image>?"}, {"role": "user", "content": [{"path": "a.png"}, "x"]}])
