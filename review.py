"""The best model in TensorBoard, beside the document's three curves: at the end of a run, global rank 0 writes
its mistakes, its confusions, its precision and recall per digit, its graph, and the run's hyperparameters
beside its result. Once per finished run: a restart writes nothing twice. Pillow draws the mistakes.
"""
import math
import os
import warnings

import torch

from common import TRAINING_FLAGS, SimpleCNN


def best_model(writer, args, best_model_path, val_loader, best_val_accuracy, best_epoch, processes):
    """Write TensorBoard's IMAGES (the validation digits the best model gets wrong), TEXT (its confusion matrix),
    PR CURVES (one per digit), GRAPHS and HPARAMS (the training flags and processes beside the best accuracy
    and epoch) for best_model.pth, at step --epochs. Every validation image counts once: val_loader holds all
    of them, whatever share of them its sampler gives this process."""
    if not os.path.exists(best_model_path):  # no epoch was better than 0%
        return
    step = args.epochs
    hparams = {**{name: getattr(args, name) for name in TRAINING_FLAGS}, 'epochs': args.epochs, 'processes': processes}
    model = SimpleCNN().to(val_loader.images.device)
    model.load_state_dict(torch.load(best_model_path, map_location=val_loader.images.device, weights_only=True))
    model.eval()
    with torch.no_grad():
        probabilities = torch.cat([torch.softmax(model(batch), dim=1) for batch in val_loader.images.split(1000)])
    labels, read = val_loader.labels.cpu(), probabilities.argmax(dim=1).cpu()
    probabilities = probabilities.cpu()
    matrix = torch.bincount(labels * 10 + read, minlength=100).view(10, 10)  # rows: the true digit
    wrong = (read != labels).nonzero()[:, 0]
    wrong = wrong[probabilities[wrong, read[wrong]].argsort(descending=True)][:64]  # the surest mistakes first
    images = val_loader.images[wrong.to(val_loader.images.device)].cpu()
    writer.add_image('Best model/mistakes (true > read as), the surest first',
                     _mistakes_picture(images, labels[wrong], read[wrong]), step, dataformats='HWC')
    table = '\n'.join(f'| **{t}** | ' + ' | '.join(str(int(n)) for n in row) + ' |' for t, row in enumerate(matrix))
    writer.add_text('Best model/confusion matrix', f'{int(matrix.trace())} of {int(matrix.sum())} read right, '
                    f'{int(matrix.sum() - matrix.trace())} mistakes ({len(wrong)} shown).\n\n| true \\ read | ' +
                    ' | '.join(map(str, range(10))) + ' |\n|' + '---|' * 11 + '\n' + table, step)
    for digit in range(10):
        writer.add_pr_curve(f'Best model/digit {digit}', labels == digit, probabilities[:, digit], step)
    with warnings.catch_warnings():  # newer torch calls its tracer deprecated; add_graph still uses it
        warnings.simplefilter('ignore', FutureWarning)
        writer.add_graph(model, val_loader.images[:1])
    writer.add_hparams(hparams, {'hparam/best_accuracy': best_val_accuracy, 'hparam/best_epoch': best_epoch},
                       run_name='.', global_step=step)  # this run's own folder: one row per run
    writer.flush()


def _font(size):
    """Pillow's own font at size pixels (Pillow 10.1 and newer), else its small bitmap one."""
    from PIL import ImageFont
    try:
        return ImageFont.load_default(size=size)
    except TypeError:
        return ImageFont.load_default()


def _mistakes_picture(images, labels, read):
    """Up to 64 digits [N, 1, 28, 28] (normalized) in 8 columns, each twice its size over 'true > read'."""
    from PIL import Image, ImageDraw
    columns, cell, font = 8, (64, 80), _font(14)
    picture = Image.new('RGB', (columns * cell[0], max(1, math.ceil(len(images) / columns)) * cell[1]), 'white')
    draw = ImageDraw.Draw(picture)
    for k, (image, true, seen) in enumerate(zip(images, labels.tolist(), read.tolist())):
        x, y = k % columns * cell[0], k // columns * cell[1]
        pixels = ((image[0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        digit = Image.frombytes('L', (28, 28), bytes(pixels.flatten().tolist())).resize((56, 56), Image.NEAREST)
        picture.paste(digit, (x + 4, y + 2))
        draw.text((x + 14, y + 60), f'{true} > {seen}', fill=(170, 0, 0), font=font)
    return torch.frombuffer(bytearray(picture.tobytes()), dtype=torch.uint8).view(picture.height, picture.width, 3)
