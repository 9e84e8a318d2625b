"""OpenAI's cursor pages: newest first (or oldest), ``after`` an id of the previous page's last item,
and ``has_more``. Ordered by (created_at, id), so items made in the same instant keep one order and
an item made while a client pages through never shifts the pages it has not read yet."""

from __future__ import annotations

from sqlalchemy import Select, and_, or_


def page_after(query: Select, created, id_, after: tuple[float, str] | None, limit: int,
               descending: bool = True) -> Select:
    """``query`` ordered, cut after the item ``after`` (its created_at and id), one more than ``limit``
    (the extra row says whether there is more)."""
    if after is not None:
        at, after_id = after
        if descending:
            query = query.where(or_(created < at, and_(created == at, id_ < after_id)))
        else:
            query = query.where(or_(created > at, and_(created == at, id_ > after_id)))
    order = (created.desc(), id_.desc()) if descending else (created.asc(), id_.asc())
    return query.order_by(*order).limit(limit + 1)


def list_object(items: list[dict], limit: int) -> dict:
    """OpenAI's list object from up to ``limit + 1`` items."""
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}
