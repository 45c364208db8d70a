"""aotx-chat and several models: the model picker and each conversation's model.

Owns: Ctrl+O (``action_pick_model``: the engine's ``ListModels`` in ``ModelPicker``; the
choice switches the open conversation with ``SwitchModel``, its history kept and read
again by the new model, or, with no conversation open, becomes the model of the next new
one: ``next_model``) and showing the open conversation's model in the status line and
each conversation's (when it is not the engine's default) in the sidebar. A mixin of
``ChatApp``: it uses the app's ``client``, ``conv_id``, ``conv_view``, ``status_bar``,
``sidebar``, ``show_notice``, ``refresh_conversations`` and ``_call``.
"""

from __future__ import annotations

from textual import work

from aotx.app.screens.model_picker import ModelPicker
from aotx.engine import protocol as P


class ModelActions:
    next_model: str = ""  # the model of the next conversation this app creates ("": the engine's default)

    def show_conversation_model(self, view: P.ConversationView | None) -> None:
        """The status line names the open conversation's model (or the next new one's)."""
        model = view.model if view is not None and view.model else self.next_model
        self.status_bar.set_conversation_model(model)

    @work(group="ui")
    async def action_pick_model(self) -> None:
        if self.client is None:
            self.show_notice("The engine is not connected yet.", "warning")
            return
        listed = await self._call(self.client.list_models())
        if listed is None:
            return
        default = next((m.name for m in listed.models if m.default), "")
        current = (self.conv_view.model if self.conv_view is not None else "") or self.next_model or default
        name = await self.push_screen_wait(ModelPicker(listed.models, current))
        if not name or name == current:
            return
        if self.conv_id is None:
            self.next_model = name
            self.status_bar.set_conversation_model(name)
            self.show_notice(f"New conversations run on {name}.")
            return
        view = await self._call(self.client.switch_model(self.conv_id, name))
        if view is not None:
            self.conv_view = view
            self.status_bar.set_conversation_model(name)
            self.show_notice(f"This conversation runs on {name} from the next message: {name} reads its history "
                             f"again; {current}'s saved state stays valid for {current}.")
            await self.refresh_conversations()
