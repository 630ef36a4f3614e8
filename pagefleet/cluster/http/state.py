"""What the routes share, kept on the app (`app.state`) and handed to them by FastAPI."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .serving import Serving


def serving_of(request: Request) -> Serving:
    return request.app.state.serving


# A route's `serving: ServingDep` parameter: this app's `Serving`.
ServingDep = Annotated[Serving, Depends(serving_of)]
