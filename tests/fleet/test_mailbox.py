"""megarl.fleet.mailbox: a put from another thread wakes the socket thread's poller at once."""
import threading

import zmq

from megarl.fleet.mailbox import Mailbox


def test_a_put_from_another_thread_wakes_the_poller_and_take_all_keeps_the_order():
    box = Mailbox()
    poller = zmq.Poller()
    poller.register(box.fileno(), zmq.POLLIN)
    try:
        assert poller.poll(0) == []  # nothing put: nothing to wake for
        putter = threading.Thread(target=lambda: [box.put(i) for i in range(3)])
        putter.start()
        putter.join()
        assert dict(poller.poll(10_000)) == {box.fileno(): zmq.POLLIN}  # 10 s: only a broken wake-up waits
        assert list(box.take_all()) == [0, 1, 2]
        assert box.empty() and poller.poll(0) == []  # the wake-ups went with the items
        box.put("late")
        assert poller.poll(0) and list(box.take_all()) == ["late"]
    finally:
        box.close()


def test_many_puts_never_block_the_putter():
    box = Mailbox()
    try:
        for i in range(200_000):  # more wake-up bytes than a pipe holds: the extra ones are skipped
            box.put(i)
        taken = list(box.take_all())
        assert taken == list(range(200_000))
    finally:
        box.close()
