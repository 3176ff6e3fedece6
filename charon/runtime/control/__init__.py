"""The engine side of the control surface, shared by every controllable engine: pause/resume (the epoch gate and
:class:`~charon.runtime.control.controls.GatedControls`), code versions, the inspector, consistent reads and the SQL
sandbox, data-directory ownership and bounded log probes."""
