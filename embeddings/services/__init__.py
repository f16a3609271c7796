"""Services write, selectors read (HackSoftware Django-Styleguide). Views and tasks call these."""
