"""Random data augmentations for images stored H x W x C. Each call draws from NumPy's global RNG."""
import numpy as np

__all__ = ["RandomCrop", "RandomFlipHorizontal", "Transform"]


class Transform:
    """A callable image -> image."""

    def __call__(self, x):
        raise NotImplementedError


class RandomFlipHorizontal(Transform):
    """Flip the width axis of an H x W x C image with probability p (one `np.random.rand()` per call)."""

    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, img):
        flip = np.random.rand() < self.p
        return img[:, ::-1, :] if flip else img


class RandomCrop(Transform):
    """Shift an H x W x C image by up to `padding` pixels in height and width, filling with zeros.

    One `np.random.randint(-padding, padding + 1, size=2)` per call gives the shifts (sx of height, sy of width);
    the image is zero-padded by `padding` on both sides of H and W and the original-size window at
    (padding + sx, padding + sy) is returned.
    """

    def __init__(self, padding=3):
        self.padding = padding

    def __call__(self, img):
        shift_x, shift_y = np.random.randint(low=-self.padding, high=self.padding + 1, size=2)
        H, W = img.shape[0], img.shape[1]
        p = self.padding
        padded = np.pad(img, ((p, p), (p, p)) + ((0, 0),) * (img.ndim - 2))
        return padded[p + shift_x:p + shift_x + H, p + shift_y:p + shift_y + W]
